"""Client load for restart tests and benchmarks: N threads, one request per connection each,
every answer checked, until stopped; and a flood of connections that hold half a request head."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge.serve.bench import percentile
from edge.serve.client import request

__all__ = ["ClientLoad", "HALF_HEAD", "LoadResult", "half_heads"]

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def half_heads(address: tuple[str, int], n: int) -> list[socket.socket]:
    """`n` connections that each send half a request head and hold it (an idle-connection
    flood, as slowloris clients make it); the caller closes them."""
    flood: list[socket.socket] = []
    try:
        for _ in range(n):
            flood.append(socket.create_connection(address, timeout=30))
            flood[-1].sendall(HALF_HEAD)
    except BaseException:
        for c in flood:
            c.close()
        raise
    return flood


@dataclass
class LoadResult:
    ok: int = 0
    refused: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    @property
    def longest_s(self) -> float:
        return max(self.latencies, default=0.0)

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


class ClientLoad:
    """N client threads sending one request per connection in a loop until stopped (bounded by
    `max_seconds`); each answer is checked by `check(status, body)`."""

    def __init__(self, address: tuple[str, int], body: bytes, *, path: str = "/v1/completions",
                 clients: int = 8, max_seconds: float = 120.0, timeout: float = 120.0,
                 check: Callable[[int, bytes], bool] | None = None) -> None:
        self.address, self.path, self.body = address, path, body
        self.clients, self.max_seconds, self.timeout = clients, max_seconds, timeout
        self.check = check or (lambda status, body: status == 200)
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _one(self) -> tuple[int, bytes]:
        return request(self.address, "POST", self.path, self.body, timeout=self.timeout)

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                status, body = self._one()
                good = self.check(status, body)
                err = None if good else f"HTTP {status}: {body[:200]!r}"
            except ConnectionRefusedError as exc:
                good, err = False, f"refused: {exc}"
            except OSError as exc:
                good, err = False, f"{type(exc).__name__}: {exc}"
            with self._lock:
                if good:
                    self.result.ok += 1
                    self.result.latencies.append(time.monotonic() - t0)
                    self._answered.notify_all()
                elif err and err.startswith("refused"):
                    self.result.refused += 1
                else:
                    self.result.errors += 1
                if err and len(self.result.error_samples) < 10:
                    self.result.error_samples.append(f"{err} (at {time.monotonic():.3f})")

    def wait_ok(self, count: int, timeout: float = 60.0) -> int:
        """Wait until `count` requests in all were answered correctly; the number answered."""
        with self._answered:
            if not self._answered.wait_for(lambda: self.result.ok >= count, timeout):
                raise TimeoutError(f"{self.result.ok} of {count} answers in {timeout} s: "
                                   f"{self.result.error_samples}")
            return self.result.ok

    def start(self) -> "ClientLoad":
        self._threads = [threading.Thread(target=self._loop, name=f"client-{i}", daemon=True)
                         for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.result
