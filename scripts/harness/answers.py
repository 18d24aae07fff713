"""Requests read to their end as a client sees them, for the drain and handover tests and the
soak benchmark: one request per connection (HTTP/1.1, kept alive as clients keep it), its answer
parsed with h11 until the response is whole or the server closes: its status, its body, for a
stream whether it ended with `data: [DONE]` and whether it carried an error event; a 5xx that says
`Retry-After` retried as OpenAI's SDK retries (at most `retries` times, after the time it says).

`Clients` runs N such requests at once, each in its thread, and keeps every answer; `Loop` keeps N
clients asking one request after another until stopped.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11

__all__ = ["Answer", "Clients", "Loop", "ask"]


@dataclass
class Answer:
    body_sent: dict[str, Any]
    statuses: list[int] = field(default_factory=list)  # every attempt's status (0: no answer)
    body: bytes = b""  # the last attempt's body, de-chunked
    whole: bool = False  # the last attempt's response ended as HTTP says (its last chunk, or its length)
    error: str = ""  # the last attempt's failure (a reset, a timeout, a cut response)
    started: float = 0.0
    ended: float = 0.0

    @property
    def status(self) -> int:
        return self.statuses[-1] if self.statuses else 0

    @property
    def streamed(self) -> bool:
        return bool(self.body_sent.get("stream"))

    def events(self) -> list[bytes]:
        return [e[len(b"data: "):] for e in self.body.split(b"\n\n") if e.startswith(b"data: ")]

    @property
    def done(self) -> bool:
        """A stream whose last event is [DONE], in a whole response."""
        ev = self.events()
        return self.whole and bool(ev) and ev[-1] == b"[DONE]"

    @property
    def error_event(self) -> dict[str, Any] | None:
        for e in self.events():
            if e.startswith(b"{") and b'"error"' in e[:12]:
                return json.loads(e)["error"]
        return None

    def json(self) -> Any:
        return json.loads(self.body)


def _once(address: tuple[str, int], path: str, raw: bytes, timeout: float) -> tuple[int, dict[bytes, bytes], bytes, bool]:
    """(status, headers, body, whole) of one request on a fresh connection."""
    conn = h11.Connection(h11.CLIENT)
    status, headers, body, whole = 0, {}, bytearray(), False
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(conn.send(h11.Request(method="POST", target=path, headers=[
            ("Host", "edge"), ("Content-Type", "application/json"), ("Content-Length", str(len(raw)))])))
        s.sendall(conn.send(h11.Data(data=raw)) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(s.recv(65536))  # b"": the server closed
                continue
            if isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                whole = True
                break
            elif isinstance(event, h11.ConnectionClosed):
                break
    return status, headers, bytes(body), whole


def ask(address: tuple[str, int], body: dict[str, Any], *, path: str = "/v1/completions", timeout: float = 120.0,
        retries: int = 0) -> Answer:
    """`body` POSTed to `path`; retried (at most `retries` times) while the answer is a 5xx with
    Retry-After, after the time it says, as OpenAI's SDK does."""
    answer = Answer(body, started=time.monotonic())
    raw = json.dumps(body).encode()
    for attempt in range(retries + 1):
        try:
            status, headers, answer.body, answer.whole = _once(address, path, raw, timeout)
            answer.error = "" if answer.whole else "the server closed before the response was whole"
        except (OSError, h11.ProtocolError) as exc:
            status, headers, answer.body, answer.whole, answer.error = 0, {}, b"", False, f"{type(exc).__name__}: {exc}"
        answer.statuses.append(status)
        wait = headers.get(b"retry-after")
        if status < 500 or wait is None or attempt == retries:
            break
        time.sleep(min(float(wait), 10.0))
    answer.ended = time.monotonic()
    return answer


class Clients:
    """`bodies` asked at once, one thread each (`ask` with `retries` and `timeout`); `answers` in
    the order of `bodies` once `wait()` returns."""

    def __init__(self, address: tuple[str, int], bodies: list[dict[str, Any]], *, retries: int = 0,
                 timeout: float = 120.0, path: str = "/v1/completions") -> None:
        self.answers: list[Answer | None] = [None] * len(bodies)
        self._threads = [threading.Thread(target=self._run, args=(i, address, b, retries, timeout, path),
                                          name=f"client-{i}", daemon=True) for i, b in enumerate(bodies)]

    def _run(self, i: int, address: tuple[str, int], body: dict[str, Any], retries: int, timeout: float,
             path: str) -> None:
        self.answers[i] = ask(address, body, path=path, timeout=timeout, retries=retries)

    def start(self) -> "Clients":
        for t in self._threads:
            t.start()
        return self

    def wait(self, timeout: float) -> list[Answer]:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        missing = [i for i, a in enumerate(self.answers) if a is None]
        if missing:
            raise TimeoutError(f"clients {missing} had no answer after {timeout} s")
        return [a for a in self.answers if a is not None]


class Loop:
    """`clients` threads, each asking `body_for(client, n)` (its n-th request) again and again until
    `stop()`; every answer kept (`answers`), `count()` of them so far."""

    def __init__(self, address: tuple[str, int], clients: int, body_for: Callable[[int, int], dict[str, Any]], *,
                 retries: int = 0, timeout: float = 120.0, path: str = "/v1/completions") -> None:
        self.answers: list[Answer] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._args = (address, body_for, retries, timeout, path)
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"loop-{i}", daemon=True)
                         for i in range(clients)]

    def _run(self, i: int) -> None:
        address, body_for, retries, timeout, path = self._args
        n = 0
        while not self._stop.is_set():
            a = ask(address, body_for(i, n), path=path, timeout=timeout, retries=retries)
            n += 1
            with self._lock:
                self.answers.append(a)
                self._lock.notify_all()

    def start(self) -> "Loop":
        for t in self._threads:
            t.start()
        return self

    def wait_count(self, n: int, timeout: float) -> int:
        """Until `n` answers in all came (TimeoutError after `timeout`); how many came."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self.answers) >= n, timeout):
                raise TimeoutError(f"{len(self.answers)} of {n} answers after {timeout} s")
            return len(self.answers)

    def stop(self, timeout: float) -> list[Answer]:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return list(self.answers)
