"""`edge bench`: latency and throughput of a running edge service, from the device itself.

A bounded number of requests (one per connection, `concurrency` at a time) against the OpenAI
completions endpoint; JSON with p50/p95/p99 latency, requests/s, generated tokens/s, errors.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from typing import Any

__all__ = ["bench", "percentile"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def bench(url: str, *, requests: int, concurrency: int, prompt: str, max_tokens: int,
          model: str | None = None) -> dict[str, Any]:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"expected an http:// URL of the service, found {url!r}")
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **({"model": model} if model else {})})
    lock, todo = threading.Lock(), [requests]
    latencies: list[float] = []
    tokens, errors = [0], []

    def one() -> None:
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=300)
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            c.close()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            n = json.loads(data)["usage"]["completion_tokens"]
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += n
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            with lock:
                errors.append(str(exc))

    def worker() -> None:
        while True:
            with lock:
                if todo[0] <= 0:
                    return
                todo[0] -= 1
            one()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"url": url, "requests": requests, "concurrency": concurrency, "ok": len(latencies),
            "errors": len(errors), "error_samples": errors[:3], "wall_s": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 2), "tokens_per_s": round(tokens[0] / wall, 1),
            "p50_s": round(percentile(latencies, 0.5), 4), "p95_s": round(percentile(latencies, 0.95), 4),
            "p99_s": round(percentile(latencies, 0.99), 4)}
