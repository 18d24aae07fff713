"""The tests' one HTTP client: a request on a fresh connection, the JSON (or text) answer."""

from __future__ import annotations

import http.client
import json
from typing import Any

__all__ = ["call", "post", "get", "metric"]


def call(address: tuple[str, int], method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    c = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
    finally:
        c.close()
    return r.status, (json.loads(raw) if raw.startswith("{") else raw)


def post(address: tuple[str, int], path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    return call(address, "POST", path, body, timeout)


def get(address: tuple[str, int], path: str, timeout: float = 60) -> tuple[int, Any]:
    return call(address, "GET", path, None, timeout)


def metric(address: tuple[str, int], name: str) -> float:
    """One sample of the service's /metrics (Prometheus text), by its full name."""
    _, text = get(address, "/metrics")
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))
