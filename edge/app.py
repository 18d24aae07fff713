"""The HTTP API: OpenAI-compatible completions and chat (with SSE streaming), health, metrics.

Built from a finished ServiceState, so tests and warm-up build their own app; no module state.
Every client error is a JSON body {"error": {...}} with a 4xx status, and the service keeps
serving after any of them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from edge.errors import BackendError, EdgeError, RequestError
from edge.limits import check_prompt_text
from edge.llm import GenParams, Job
from edge.metrics import Metrics
from edge.worker import ModelWorker

__all__ = ["ServiceState", "build_app"]

log = logging.getLogger("edge")


@dataclass
class ServiceState:
    workers: dict[str, ModelWorker]
    engines: dict[str, Any] = field(default_factory=dict)  # name -> EngineWorker
    metrics: Metrics = field(default_factory=Metrics)
    ready: bool = False
    stopping: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def worker(self, name: Any) -> ModelWorker:
        if not self.workers:
            raise RequestError("no language model is served here (only engines: use /v2/models)",
                               status=404, param="model", code="model_not_found")
        if name is None:
            return next(iter(self.workers.values()))
        if not isinstance(name, str) or name not in self.workers:
            raise RequestError(f"model {name!r} is not served here; models: {sorted(self.workers)}",
                               status=404, param="model", code="model_not_found")
        return self.workers[name]


def _error(exc: EdgeError) -> JSONResponse:
    status = exc.status if isinstance(exc, RequestError) else 500
    body = {"message": str(exc), "type": "invalid_request_error" if status < 500 else "server_error",
            "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, found {type(body).__name__}")
    return body


def _field(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any,
           lo: float | None = None, hi: float | None = None) -> Any:
    val = body.get(name, default)
    if val is None:
        return default
    if isinstance(val, bool) and bool not in types or not isinstance(val, types):
        raise RequestError(f"{name} must be {' or '.join(t.__name__ for t in types)}, "
                           f"found {json.dumps(val)[:40]}", param=name)
    if (lo is not None and val < lo) or (hi is not None and val > hi):
        raise RequestError(f"{name} must be in [{lo}, {hi}], found {val}", param=name)
    return val


def _params(body: dict[str, Any], worker: ModelWorker) -> GenParams:
    m = worker.model
    if _field(body, "n", (int,), 1) != 1:
        raise RequestError("n must be 1: edge returns one choice per request", param="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    return GenParams(
        max_tokens=_field(body, "max_tokens", (int,), m.cfg.max_tokens_default, 1, m.n_ctx),
        temperature=float(_field(body, "temperature", (int, float), 0.8, 0.0, 2.0)),
        top_p=float(_field(body, "top_p", (int, float), 0.95, 0.0, 1.0)),
        top_k=_field(body, "top_k", (int,), 40, 0, 1 << 20),
        stop=tuple(stop),
        seed=_field(body, "seed", (int,), None, 0, 2**32 - 1),
    )


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string (or a list of one string)", param="prompt")
    return prompt


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with string role and content",
                               param="messages")
    return msgs


class _Completion:
    """One request's shape: how to turn pieces into OpenAI JSON, streamed or whole."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def _choice(self, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        content = {"content": text} if (text or not delta) else {}
        return {"index": 0, key: {"role": "assistant", **content}, "finish_reason": finish}

    def whole(self, text: str, finish: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(text, finish, False)], "usage": usage}

    def chunk(self, text: str, finish: str | None) -> bytes:
        obj = self.object + (".chunk" if self.chat else "")
        data = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice(text, finish, True)]}
        return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def _complete(request: Request, state: ServiceState, chat: bool) -> Response:
    body = await _json_body(request)
    worker = state.worker(body.get("model"))
    params = _params(body, worker)
    stream = _field(body, "stream", (bool,), False)
    m = worker.model
    if chat:
        messages = _messages(body)
        check_prompt_text(m, [msg["content"] for msg in messages], "messages")
        tokens, stop = await worker.call(m.tokenize_chat, messages)
        params = GenParams(**{**params.__dict__, "stop": params.stop + stop})
    else:
        prompt = _prompt(body)
        check_prompt_text(m, [prompt], "prompt")
        tokens = await worker.call(m.tokenize_prompt, prompt)
    if body.get("max_tokens") is None and len(tokens) < m.n_ctx:
        # no explicit limit: the configured default, but never more than the context has left
        params = GenParams(**{**params.__dict__, "max_tokens": min(params.max_tokens, m.n_ctx - len(tokens))})
    m.check_fits(len(tokens), params.max_tokens)
    job = Job(tokens=tokens, params=params)
    shape = _Completion(chat, m.cfg.name)
    metrics = state.metrics
    if stream:
        return StreamingResponse(_sse(worker, job, shape, metrics), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    parts, finish = [], None
    async for piece in worker.stream(job):
        parts.append(piece.text)
        finish = piece.finish_reason or finish
    metrics.tokens(len(tokens), job.completion_tokens)
    usage = {"prompt_tokens": len(tokens), "completion_tokens": job.completion_tokens,
             "total_tokens": len(tokens) + job.completion_tokens}
    return JSONResponse(shape.whole("".join(parts), finish, usage))


async def _sse(worker: ModelWorker, job: Job, shape: _Completion, metrics: Metrics) -> AsyncIterator[bytes]:
    if shape.chat:
        yield shape.chunk("", None)  # the role-only first delta clients expect
    try:
        async for piece in worker.stream(job):
            if piece.text or piece.finish_reason:
                yield shape.chunk(piece.text, piece.finish_reason)
    except EdgeError as exc:  # headers are gone: report in-band, as OpenAI does
        yield b"data: " + json.dumps({"error": {"message": str(exc)}}).encode() + b"\n\n"
    finally:  # counted also when the client went away mid-stream
        metrics.tokens(len(job.tokens), job.completion_tokens)
    yield b"data: [DONE]\n\n"


def build_app(state: ServiceState) -> Starlette:
    async def guarded(request: Request, handler: Any) -> Response:
        t0 = time.perf_counter()
        try:
            resp = await handler(request)
        except EdgeError as exc:
            resp = _error(exc)
        except Exception as exc:  # never let one request take the service down
            log.exception("internal error answering %s", request.url.path)
            resp = _error(BackendError(f"internal error: {type(exc).__name__}: {exc}"))
        state.metrics.request(request.url.path, resp.status_code, time.perf_counter() - t0)
        return resp

    async def completions(request: Request) -> Response:
        return await guarded(request, lambda r: _complete(r, state, chat=False))

    async def chat(request: Request) -> Response:
        return await guarded(request, lambda r: _complete(r, state, chat=True))

    async def models(request: Request) -> Response:
        data = [{"id": n, "object": "model", "created": state.created, "owned_by": "edge",
                 "meta": {"n_ctx": w.model.n_ctx, **w.model.info.summary()}}
                for n, w in state.workers.items()]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        if state.ready and not state.stopping:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "stopping" if state.stopping else "starting"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(state.metrics.render(state), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if state.engines:
        from edge.kserve import kserve_routes

        routes += kserve_routes(state, guarded)
    return Starlette(routes=routes)
