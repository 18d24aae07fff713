"""Whether the request in hand is warm-up traffic: a key in the ASGI scope that only the warm-up's
private transport (`warmup_transport`, over socket pairs of the process: no listener) sets, and a context variable the metrics middleware
sets from it for the handler and every task it spawns (`in_warmup`).

A scope key is not something an HTTP client can send: no header, path or body reaches it, so an
external client cannot pass its traffic off as warm-up to hide it. The app, the workers and the
metrics read it here; an engine's batcher (a floor below) is told by its worker."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WARMUP_SCOPE_KEY", "in_warmup", "is_warm", "request_scope", "warmup_transport"]

WARMUP_SCOPE_KEY = "edge.lifecycle.warmup"
ASGIApp = Any  # (scope, receive, send) -> awaitable

# Not state: a declaration whose value lives in each request's context (set by `request_scope`).
_IN_WARMUP: contextvars.ContextVar[bool] = contextvars.ContextVar("edge_metrics_in_warmup", default=False)


def in_warmup() -> bool:
    """Whether the request being handled came over the warm-up's private transport."""
    return _IN_WARMUP.get()


def is_warm(scope: dict[str, Any]) -> bool:
    return scope.get(WARMUP_SCOPE_KEY) is True


@contextmanager
def request_scope(scope: dict[str, Any]) -> Iterator[None]:
    """`in_warmup()` answers for `scope`'s request inside this block (and the tasks it spawns)."""
    token = _IN_WARMUP.set(is_warm(scope))
    try:
        yield
    finally:
        _IN_WARMUP.reset(token)


def warmup_transport(app: ASGIApp) -> ASGIApp:
    """`app` as served over the warm-up's private socket pairs: every request's scope carries
    the warm-up key (set here, by the transport, never from anything the client sends)."""

    async def marked(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app({**scope, WARMUP_SCOPE_KEY: True}, receive, send)

    return marked
