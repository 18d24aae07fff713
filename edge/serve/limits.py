"""What one client may send: request bodies and prompt sizes; and the descriptors connections need.

The connection cap, its shedding and the header timeout are `edge.serve.connections`.

Request level (`LimitsMiddleware`, plain ASGI around the app):
- a body over `max_body_bytes` is a 413 as soon as that is known: from Content-Length before
  anything is read, else while counting the streamed bytes;
- a body not complete within `body_timeout_s` is a 408;
- JSON nested deeper than `edge.serve.jsoncheck.MAX_JSON_DEPTH` arrays/objects is a 400 naming the
  limit, measured without parsing (Python's parser recurses once per level and fails near a
  thousand); then a JSON string holding a lone UTF-16 surrogate (`"\\ud800"`, which no backend
  can encode) is a 400 naming the field;
- the app then gets the whole body at once; an exception escaping it is logged once, with its
  traceback, and answered 500 (an internal failure, never one of the input checks above);
  so is one in these checks themselves.

What this layer answers itself never reaches the app's metrics middleware: it hands each answer
to `observe(scope, status, seconds)`, so that `edge_requests_total` counts it like any other.
Exceptions of the app are counted by the app's own middleware (status 500), not here again.

`check_prompt_bytes` refuses a prompt that cannot fit the context before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from edge.config import ServerConfig
from edge.errors import RequestError
from edge.serve.jsoncheck import check_json_depth, refuse_lone_surrogates

__all__ = ["LimitsMiddleware", "Observe", "RequestLimits", "check_prompt_bytes", "check_prompt_text",
           "connection_limit", "nofile_for", "send_error"]

log = logging.getLogger("edge")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Observe = Callable[[Scope, int, float], None]  # (scope, status, seconds): one answer, for metrics


# -- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int
    body_timeout_s: float

    @classmethod
    def of(cls, cfg: ServerConfig) -> "RequestLimits":
        return cls(cfg.max_body_bytes, cfg.body_timeout_s)


class _Disconnected(Exception):
    pass


_INTERNAL = RequestError("internal error (logged by the service)", status=500, code="internal_error")


class LimitsMiddleware:
    """ASGI: body size and time limits, JSON depth and lone surrogates refused, and the
    last-resort catch-all; what it answers itself goes to `observe`."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, observe: Observe | None = None) -> None:
        self.app, self.limits, self.observe = app, limits, observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            body = await self._body(scope, receive)
        except RequestError as exc:
            await self._answer(scope, send, exc, t0)
            return
        except _Disconnected:
            return  # the client went away before its body arrived: nobody to answer
        except Exception:
            log.exception("internal error checking %s %s", scope.get("method"), scope.get("path"))
            await self._answer(scope, send, _INTERNAL, t0)
            return
        try:
            await self.app(scope, _replay(body, receive), tracked)
        except Exception:
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:  # counted already, as a 500, by the app's metrics middleware
                await send_error(send, _INTERNAL)

    async def _answer(self, scope: Scope, send: Send, exc: RequestError, t0: float) -> None:
        await send_error(send, exc)
        if self.observe is not None:
            self.observe(scope, exc.status, time.perf_counter() - t0)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _too_large(declared, limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RequestError(f"request body not complete after {self.limits.body_timeout_s:g} s "
                                   f"(server.body_timeout_s): {size} bytes arrived", status=408,
                                   code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, counted=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        check_json_depth(body)  # first: the surrogate check parses the body
        refuse_lone_surrogates(body)
        return body


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has refused a malformed one already
    return None


def _too_large(size: int, limit: int, counted: bool = False) -> RequestError:
    what = f"more than {limit} bytes arrived" if counted else f"Content-Length is {size} bytes"
    return RequestError(f"request body too large: {what}; the limit is {limit} bytes "
                        "(server.max_body_bytes)", status=413, code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: only http.disconnect is left to come

    return replay


async def send_error(send: Send, exc: RequestError) -> None:
    """The service's JSON error body ({"error": {...}}, as the app answers) for `exc`."""
    body = json.dumps({"error": {"message": str(exc), "type": "invalid_request_error" if exc.status < 500
                                 else "server_error", "param": exc.param, "code": exc.code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 408:  # the rest of a slow body is not worth waiting for
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def check_prompt_text(model: Any, texts: list[str], param: str) -> None:
    """`check_prompt_bytes` for a loaded model (edge.model.llm.GGUFModel) and the texts of a request."""
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    check_prompt_bytes(n_bytes, model.n_ctx, model.info.max_token_bytes, param)


def check_prompt_bytes(n_bytes: int, n_ctx: int, max_token_bytes: int | None, param: str) -> None:
    """Refuse, before tokenizing, a prompt of `n_bytes` (UTF-8) that cannot fit `n_ctx` tokens:
    no token of the vocabulary is longer than `max_token_bytes` (from the GGUF), so such a prompt
    has more than n_ctx tokens whatever it says. Tokenizing it would hold the model's worker."""
    per_token = max_token_bytes or 64
    if n_bytes > n_ctx * per_token:
        raise RequestError(f"{param} is {n_bytes} bytes: more than the context of {n_ctx} tokens can "
                           f"hold (no token of this model is longer than {per_token} bytes)",
                           param=param, code="context_length_exceeded")


# -- file descriptors ----------------------------------------------------------------------------
FD_RESERVE = 1024  # model and engine files, thread pools, eventfds, sd_notify, logs, /proc reads


def nofile_for(max_connections: int) -> int:
    """RLIMIT_NOFILE that `max_connections` open connections need (the unit's LimitNOFILE=)."""
    return max_connections + FD_RESERVE


def connection_limit(cfg: ServerConfig) -> int:
    """`server.max_connections`, raising the soft RLIMIT_NOFILE to fit it (up to the hard one);
    lowered, with a warning, where the hard limit cannot hold it."""
    import resource

    need = nofile_for(cfg.max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return cfg.max_connections
    limit = max(1, soft - min(FD_RESERVE, soft // 4))
    log.warning("server.max_connections = %d needs %d file descriptors, but RLIMIT_NOFILE is %d "
                "(LimitNOFILE= of the unit): serving at most %d connections", cfg.max_connections,
                need, soft, limit)
    return limit
