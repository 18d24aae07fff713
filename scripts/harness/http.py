"""The tests' one HTTP client: a request on a fresh connection, the JSON (or text) answer."""

from __future__ import annotations

import http.client
import json
from typing import Any

__all__ = ["call", "post", "get", "metric"]


def call(address: tuple[str, int], method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 60, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    c = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        raw = r.read().decode()
    finally:
        c.close()
    return r.status, (json.loads(raw) if raw.startswith("{") else raw)


def post(address: tuple[str, int], path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    return call(address, "POST", path, body, timeout)


def get(address: tuple[str, int], path: str, timeout: float = 60) -> tuple[int, Any]:
    return call(address, "GET", path, None, timeout)


def metric(address: tuple[str, int], name: str, **labels: str) -> float:
    """A sample of the service's /metrics by its full name, summed over the series whose labels
    include `labels` (0 for a family with no series yet); KeyError for an unknown family."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(address, "/metrics")
    total, known = 0.0, False
    for fam in text_string_to_metric_families(text):
        if not name.startswith(fam.name):
            continue
        for s in fam.samples:
            if s.name == name:
                known = True
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        known = known or name in (fam.name, fam.name + "_total")
    if not known:
        raise KeyError(f"{name} is not in /metrics")
    return total
