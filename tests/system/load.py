"""Clients for the restart test: run inside the container's network namespace (loopback only).

`python load.py PORT NEW KEEPALIVE` starts NEW clients that open a connection per request and
KEEPALIVE clients that reuse one connection (HTTP/1.1 keep-alive), each sending completions in a
loop. It prints `ok <n> failed <m>` after every 10th answer, and when stdin closes it stops the
clients and prints one JSON line: counts and the first errors. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading

BODY = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = self.failed = 0
        self.errors: list[str] = []

    def add(self, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.ok += 1
                if self.ok % 10 == 0:
                    print(f"ok {self.ok} failed {self.failed}", flush=True)
            else:
                self.failed += 1
                self.errors.append(error)


def one(conn: http.client.HTTPConnection) -> str | None:
    try:
        conn.request("POST", "/v1/completions", body=BODY, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        return f"{type(exc).__name__}: {exc}"
    return None if r.status == 200 else f"HTTP {r.status}"


def client(port: int, keepalive: bool, stop: threading.Event, tally: Tally) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while not stop.is_set():
        if not keepalive:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        tally.add(one(conn))
        if not keepalive:
            conn.close()


def main() -> None:
    port, new, keep = (int(a) for a in sys.argv[1:4])
    stop, tally = threading.Event(), Tally()
    threads = [threading.Thread(target=client, args=(port, i >= new, stop, tally)) for i in range(new + keep)]
    for t in threads:
        t.start()
    sys.stdin.read()  # the test closes stdin to stop
    stop.set()
    for t in threads:
        t.join(timeout=180)
    print(json.dumps({"ok": tally.ok, "failed": tally.failed, "errors": tally.errors[:10]}), flush=True)


if __name__ == "__main__":
    main()
