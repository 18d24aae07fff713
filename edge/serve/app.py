"""The HTTP API: OpenAI-compatible completions and chat (with SSE streaming), health, metrics.

Built from a finished ServiceState, so tests and warm-up build their own app; no module state.
Every client error is a JSON body {"error": {...}} with a 4xx status, and the service keeps
serving after any of them. A stream's head goes out when its request leaves the model's queue,
not before: a request that waits there has been sent nothing, so a handover can still pass it on
whole (`PASSED_ON`: edge.lifecycle.handover.pass_on answers it from the new process).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from edge.errors import BackendError, EdgeError, RequestError
from edge.serve.jsoncheck import json_body
from edge.serve.limits import check_prompt_text
from edge.model.adapters import select
from edge.model.generate import GenParams, Hold, Job, Piece
from edge.model.llm import GGUFModel
from edge.model.promptcache import Marks
from edge.serve.metrics import Metrics, MetricsMiddleware
from edge.serve.openai import Ask, Limits, parse
from edge.serve.openai_shapes import Choice, Shape, model_list, parse_tool_calls
from edge.serve.schema import schema_grammar
from edge.serve.toolcall import forced_call
from edge.serve.state import ServiceState
from edge.serve.endings import PASSED_ON, DeferredStream, pass_instead, passed_on, server_ended
from edge.serve.warmscope import in_warmup
from edge.serve.worker import SERVER_ENDED, ModelWorker, PassedOn

__all__ = ["PASSED_ON", "ServiceState", "build_app"]

log = logging.getLogger(__name__)

_STARTED = Piece("")  # _merged_pieces: a choice left the queue for a slot (no text of its own)


def _error(exc: EdgeError) -> JSONResponse:
    status = exc.status if isinstance(exc, RequestError) else 500
    body = {"message": str(exc), "type": "invalid_request_error" if status < 500 else "server_error",
            "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


@dataclass
class _Generations:
    """One request's generations: its jobs in choice order and how to answer."""
    worker: ModelWorker
    ask: Ask
    jobs: list[Job]
    echoes: list[str]  # per choice: the prompt text `echo` puts before the completion
    n_prompt: int
    shape: Shape

    def prefilled_prompt_tokens(self) -> int:
        """Prompt tokens of the prompts that were prefilled: one a client left while it was
        queued never reached the model, and counts nothing."""
        per_prompt = [self.jobs[i:i + self.ask.n] for i in range(0, len(self.jobs), self.ask.n)]
        return sum(len(jobs[0].tokens) for jobs in per_prompt if any(j.prefilled for j in jobs))

    def usage(self) -> dict[str, Any]:
        done = sum(j.completion_tokens for j in self.jobs)
        cached = sum(j.cached_tokens for j in self.jobs[::self.ask.n])  # each prompt's first choice
        return {"prompt_tokens": self.n_prompt, "completion_tokens": done,
                "total_tokens": self.n_prompt + done, "prompt_tokens_details": {"cached_tokens": cached}}

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.ask.tools or []]

    def buffered(self) -> bool:
        """Tool calls are known only once the text is whole: such choices stream in one chunk."""
        return bool(self.ask.tools) and self.ask.tool_choice != "none"


def _tokenize(m: GGUFModel, ask: Ask) -> list[tuple[list[int], tuple[str, ...], str, Marks]]:
    """(tokens, template stop strings, echo text, where its chat turns begin) per prompt; runs on
    the model's thread. The turns are found only if the prompt cache needs them."""
    if ask.chat:
        tokens, stops = m.tokenize_chat(ask.messages, ask.tools, ask.tool_choice)
        return [(tokens, stops, "", partial(m.turn_marks, ask.messages, ask.tools, tokens))]
    return [(m.tokenize_prompt(p), (), p, ()) if isinstance(p, str) else
            (list(p), (), b"".join(m.token_bytes(t) for t in p).decode("utf-8", "replace"), ())
            for p in ask.prompts]


def _check_bytes(m: GGUFModel, ask: Ask) -> None:
    if ask.chat:
        texts = [c if isinstance(c, str) else " ".join(p.get("text", "") for p in c if isinstance(p, dict))
                 for c in (msg.get("content") for msg in ask.messages) if isinstance(c, (str, list))]
        check_prompt_text(m, texts, "messages")
    else:
        check_prompt_text(m, [p for p in ask.prompts if isinstance(p, str)], "prompt")


async def _prepare(body: dict[str, Any], state: ServiceState, chat: bool) -> _Generations:
    worker, adapter = state.pick(body.get("model"))
    m = worker.model
    adapters = select(m.cfg.name, state.adapters_of(worker), adapter, body.get("lora"))  # a 400 naming an unknown one
    ask = parse(body, chat, Limits(m.n_ctx, m.n_vocab, m.cfg.max_choices, m.supports_tools))
    if ask.who:
        log.info("request from %s", ", ".join(f"{k} {v!r}" for k, v in ask.who.items()))
    compiled = None
    if ask.schema is not None:  # converted once and compiled, off the loop and off the model's worker
        held = ask.schema
        gbnf = await asyncio.to_thread(schema_grammar, held.schema, held.param, held.place)
        compiled = await asyncio.to_thread(m.compile_grammar, gbnf, held.param, True)
    _check_bytes(m, ask)  # before tokenizing: a prompt that cannot fit never holds the worker
    prompts = await worker.call(_tokenize, m, ask)
    if len(prompts) * ask.n > m.cfg.max_choices:
        raise RequestError(f"{len(prompts)} prompts x n={ask.n} is more than the "
                           f"{m.cfg.max_choices} choices this model allows per request "
                           "(models[].max_choices)", param="n")
    jobs, echoes, starts = [], [], []
    # one limit for the request, whatever its choices; none for warm-up's own requests, which a
    # start makes on a model that is not warm yet (and calibration times on purpose)
    hold = Hold(None if in_warmup() else worker.request_timeout_s)
    for tokens, stops, echo, marks in prompts:
        if not tokens:  # a model that adds no BOS: nothing to compute the first token from
            raise RequestError("the prompt is empty: it has no token to generate from (this model "
                               "adds no beginning-of-sequence token)", param="messages" if chat else "prompt")
        max_tokens = ask.max_tokens
        if max_tokens is None:  # the configured default, but never more than the context has left
            max_tokens = min(m.cfg.max_tokens_default, max(1, m.n_ctx - len(tokens)))
        m.check_fits(len(tokens), max_tokens)
        # the template's stop strings end free text; under a grammar the JSON ends the output, and a
        # stop string inside one of its strings would cut it (a client's `stop` is refused there)
        params = GenParams(max_tokens=max_tokens, grammar=compiled,
                           **{**ask.sampling, "stop": ask.sampling["stop"] + (stops if compiled is None else ())})
        # n choices from one seed: seed, seed+1, ... (the same seed would give n equal choices)
        jobs += [Job(tokens=tokens, params=params if params.seed is None else
                     replace(params, seed=(params.seed + j) % (2**32 - 1)),
                     cache_prompt=ask.cache_prompt, remember=not in_warmup(), marks=marks, hold=hold,
                     adapters=adapters)
                 for j in range(ask.n)]
        echoes += [echo if ask.echo else ""] * ask.n
        starts += [0 if ask.echo else len(echo)] * ask.n  # echo: the prompt is in the choice's text
    shape = Shape(chat, m.cfg.name, ask.sampling["logprobs"] is not None, starts)
    return _Generations(worker, ask, jobs, echoes, sum(len(t) for t, *_ in prompts), shape)


def _finish_tools(run: _Generations, c: Choice) -> None:
    """A choice's tool calls, once its text is whole. A forced call is always one: its grammar
    wrote a call, which max_tokens may have cut (finish_reason `length`, the arguments' text as far
    as it got), never prose."""
    if not run.buffered():
        return
    calls = parse_tool_calls(c.text, run.tool_names())
    if calls:
        c.tool_calls = calls if run.ask.parallel_tool_calls else calls[:1]
        c.text, c.finish = "", "tool_calls"
    elif run.ask.forced_tool:
        c.tool_calls, c.text = [forced_call(c.text, run.tool_names(), c.finish)], ""


async def _choices(run: _Generations, metrics: Metrics) -> list[Choice]:
    """Every choice's whole answer; the choices generate at once (edge.model.slots)."""
    choices = [Choice(i, text=run.echoes[i]) for i in range(len(run.jobs))]
    async for i, piece in _merged_pieces(run, metrics, eager=False):  # one answer: no per-token wake-ups
        c = choices[i]
        if piece is None:
            _finish_tools(run, c)
            continue
        c.text += piece.text
        c.logprobs += piece.logprobs
        c.finish = piece.finish_reason or c.finish
    return choices


async def _merged_pieces(run: _Generations, metrics: Metrics, eager: bool,
                         announce: bool = False) -> AsyncIterator[tuple[int, Piece | None]]:
    """(choice index, piece) as the choices make them, each in its slot, all at once; (i, None)
    when choice i ends; with `announce` (a stream), (-1, None) once, when the first choice leaves
    the queue for a slot (before its pieces: one more wake-up of the loop, so only for a stream).
    An error of any choice is raised here, the others cancelled."""
    queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            started = partial(queue.put_nowait, (i, _STARTED, None)) if announce else None
            async for piece in metrics.generation(run.shape.model, run.worker.stream(job, True, eager, started)):
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(run.jobs)]
    began = False
    try:
        for _ in tasks:
            while True:
                i, piece, exc = await queue.get()
                if exc is not None:
                    raise exc
                if piece is _STARTED:
                    if not began:
                        began = True
                        yield -1, None
                    continue
                yield i, piece
                if piece is None:
                    break
    finally:
        for t in tasks:
            t.cancel()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client goes away first; then cancel it (generation stops at the
    next token, a queued job never starts) and raise _ClientGone."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    if await request.is_disconnected():  # left while queued (tokenizing waits behind generations)
        if asyncio.iscoroutine(work):
            work.close()
        raise _ClientGone
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise _ClientGone


async def _complete(request: Request, state: ServiceState, chat: bool) -> Response:
    try:
        run = await _prepare(await json_body(request), state, chat)
        run.worker.admit()  # a full queue is a 503 here, before any byte, streamed or not
    except RequestError as exc:
        if pass_instead(state.workers.values(), exc):
            return passed_on()
        raise
    if run.ask.stream:
        return DeferredStream(_sse(run, state.metrics), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        choices = await _unless_disconnected(request, _choices(run, state.metrics))
    except _ClientGone:
        _client_gone(run, state.metrics, streamed=False)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    except PassedOn:
        return passed_on()
    except RequestError as exc:
        if pass_instead([run.worker], exc):  # nothing of it was sent: it starts again in the new process
            return passed_on()
        if exc.code == SERVER_ENDED:
            server_ended(run.shape, run.usage()["completion_tokens"], streamed=False)
        raise
    finally:
        run.worker.release()
        state.metrics.tokens(run.prefilled_prompt_tokens(), run.usage()["completion_tokens"],
                             model=run.shape.model)
    return JSONResponse(run.shape.whole(choices, run.usage()))


def _client_gone(run: _Generations, metrics: Metrics, streamed: bool) -> None:
    metrics.client_abort(run.shape.model)
    log.info("status 499 (client closed request): %s for model %r, the client left %s; %d completion "
             "tokens generated", "chat completion" if run.shape.chat else "completion", run.shape.model,
             "mid-stream" if streamed else "before its answer", run.usage()["completion_tokens"])


async def _sse(run: _Generations, metrics: Metrics) -> AsyncIterator[bytes]:
    """The stream's events; nothing while its request waits in the queue (passed on from there,
    PassedOn is raised before any byte: `_Stream`)."""
    shape, finished, began = run.shape, False, False
    try:
        choices = [Choice(i, text=run.echoes[i]) for i in range(len(run.jobs))]
        async for i, piece in _merged_pieces(run, metrics, eager=not run.buffered(), announce=True):
            if i < 0:  # out of the queue: the stream begins
                began = True
                for c in choices:
                    if shape.chat:
                        yield shape.role_chunk(c.index)
                    if c.text and not run.buffered():
                        yield shape.chunk(c)
                continue
            c = choices[i]
            if piece is None:
                if run.buffered():
                    _finish_tools(run, c)
                    yield shape.chunk(c)
            elif run.buffered():
                c.text, c.finish = c.text + piece.text, piece.finish_reason or c.finish
            elif piece.text or piece.finish_reason or piece.logprobs:
                yield shape.chunk(Choice(i, piece.text, piece.logprobs, piece.finish_reason))
        if run.ask.include_usage:
            yield shape.usage_chunk(run.usage())
        finished = True
    except PassedOn:  # before its first byte (only a request none of whose choices started is passed on)
        finished = True
        raise
    except EdgeError as exc:  # headers are gone: report in-band, as OpenAI does
        finished = True
        if not began and pass_instead([run.worker], exc):
            raise PassedOn from None
        if getattr(exc, "code", None) == SERVER_ENDED:
            server_ended(run.shape, run.usage()["completion_tokens"], streamed=True)
        yield b"data: " + json.dumps({"error": {"message": str(exc), "type": "server_error" if getattr(
            exc, "status", 500) >= 500 else "invalid_request_error", "code": getattr(exc, "code", None)}}).encode() + b"\n\n"
    except Exception as exc:  # never a cut chunked body: the error in-band too, logged once
        log.exception("internal error in a stream of model %r", shape.model)
        finished = True
        yield b"data: " + json.dumps({"error": {"message": f"internal error: {type(exc).__name__}"}}).encode() + b"\n\n"
    finally:  # counted also when the client went away mid-stream
        run.worker.release()
        metrics.tokens(run.prefilled_prompt_tokens(), run.usage()["completion_tokens"], model=shape.model)
        if not finished:
            _client_gone(run, metrics, streamed=True)
    yield b"data: [DONE]\n\n"


async def _guarded(state: ServiceState, request: Request, handler: Any) -> Response:
    """A request's handler, its errors as JSON answers (never a traceback to the client)."""
    try:
        if state.fatal_reason:  # the process is leaving: no more work for its models or engines
            raise state.leaving()
        resp = await handler(request)
    except EdgeError as exc:
        resp = _error(exc)
    except Exception as exc:  # never let one request take the service down
        log.exception("internal error answering %s", request.url.path)
        resp = _error(BackendError(f"internal error: {type(exc).__name__}: {exc}"))
    return resp


def build_app(state: ServiceState) -> MetricsMiddleware:
    guarded = functools.partial(_guarded, state)

    async def completions(request: Request) -> Response:
        return await guarded(request, lambda r: _complete(r, state, chat=False))

    async def chat(request: Request) -> Response:
        return await guarded(request, lambda r: _complete(r, state, chat=True))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": model_list(state)})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        status, body = state.readiness()
        return JSONResponse(body, status_code=status)

    async def metrics(request: Request) -> Response:
        # in a thread: a scrape reads the state dir (edge.fleet.metrics), never on the event loop
        text = await asyncio.to_thread(state.metrics.render, state)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    from edge.serve.embeddings import embeddings_routes

    routes += embeddings_routes(state, guarded)
    if state.engines:
        from edge.serve.kserve import kserve_routes

        routes += kserve_routes(state, guarded)
    return state.metrics.instrument(Starlette(routes=routes), state)
