"""Clients for the give-up test: run inside the container's network namespace (loopback only).

`python probe.py PORT SECONDS CLIENTS` runs CLIENTS clients for SECONDS (0: until stdin closes), each opening a new
connection per request (a completion), reading the whole answer and closing, one request every
50 ms at most. Prints one JSON line: how many were answered, by status; how many of the answers
were the give-up's 503 (Retry-After and a JSON body naming the reason); refused connections;
other errors; the slowest request (connect to the last byte), refusals included. Standard
library only.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

BODY = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
PACE_S = 0.05  # at most 20 requests a second per client: a bounded load on a shared machine


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answered: dict[int, int] = {}
        self.given_up = self.refused = 0
        self.slowest = 0.0
        self.errors: list[str] = []

    def add(self, took: float, status: int | None = None, given_up: bool = False, error: str | None = None,
            refused: bool = False) -> None:
        with self.lock:
            self.slowest = max(self.slowest, took)
            if status is not None:
                self.answered[status] = self.answered.get(status, 0) + 1
                self.given_up += given_up
            elif refused:
                self.refused += 1
            elif error and len(self.errors) < 10:
                self.errors.append(error)


def one(port: int, tally: Tally) -> None:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=BODY, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
    except (ConnectionRefusedError, ConnectionResetError):
        tally.add(time.monotonic() - t0, refused=True)
        return
    except (OSError, http.client.HTTPException) as exc:
        tally.add(time.monotonic() - t0, error=f"{type(exc).__name__}: {exc}")
        return
    finally:
        conn.close()
    given_up = False
    if r.status == 503 and r.getheader("Retry-After", "").isdigit():
        error = json.loads(raw).get("error", {})
        given_up = error.get("code") == "given_up" and bool(error.get("reason")) and bool(error.get("phase"))
    tally.add(time.monotonic() - t0, status=r.status, given_up=given_up)


def client(port: int, stop: threading.Event, tally: Tally) -> None:
    while not stop.is_set():
        one(port, tally)
        stop.wait(PACE_S)


def main() -> None:
    port, seconds, clients = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=client, args=(port, stop, tally)) for _ in range(clients)]
    for t in threads:
        t.start()
    if seconds > 0:
        stop.wait(seconds)
    else:
        sys.stdin.read()  # the test closes stdin to stop
    stop.set()
    for t in threads:
        t.join(timeout=60)
    answered = sum(tally.answered.values())
    print(json.dumps({"answered": answered, "by_status": tally.answered, "given_up_503": tally.given_up,
                      "other": answered - tally.given_up, "refused": tally.refused, "errors": tally.errors,
                      "slowest_s": round(tally.slowest, 3)}), flush=True)


if __name__ == "__main__":
    main()
