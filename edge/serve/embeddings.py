"""`POST /v1/embeddings`: OpenAI's embeddings route, batched across inputs and requests.

Each model with an embeddings context (edge.model.embed) has one `EmbedQueue` per served app.
A request's inputs are tokenized off the model's thread (llama.cpp's tokenizer is thread-safe),
refused with a 400 naming the input when one cannot fit a batch, and queued; one batch at a
time is decoded on the model's thread between its generation steps (`ModelWorker.control`),
holding the waiting inputs of every request, oldest first, as many as fit its `n_batch` tokens. While a batch decodes, the inputs that arrive wait for the next one, so a busy model
decodes full batches and an idle one answers a lone input at once: no timer, no batch window.
A request takes a place in its model's queue like a completion (`max_queue`, else 503).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.errors import BackendError, RequestError
from edge.model.embed import finish, pack
from edge.serve.embed_request import EmbedAsk, EmbedLimits, parse_embeddings
from edge.serve.jsoncheck import json_body
from edge.serve.limits import check_prompt_bytes
from edge.serve.warmscope import in_warmup

if TYPE_CHECKING:
    import numpy as np

    from edge.model.embed import EmbedContext
    from edge.serve.state import ServiceState
    from edge.serve.worker import ModelWorker

__all__ = ["EmbedQueue", "embeddings_routes"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Input:
    tokens: list[int]
    future: asyncio.Future[Any]
    warm: bool = False  # a warm-up request's: its batch counts on /metrics only beside a client's


class EmbedQueue:
    """One model's waiting inputs and the batch being decoded (the event loop's side)."""

    def __init__(self, worker: ModelWorker, on_batch: Callable[[str, int], None] = lambda model, n: None) -> None:
        self.worker = worker
        self.ctx: EmbedContext = worker.model.embed  # type: ignore[assignment]
        self._waiting: collections.deque[_Input] = collections.deque()
        self._runner: asyncio.Future[None] | None = None
        self._on_batch = on_batch  # (model, client inputs in it): /metrics

    async def embed(self, inputs: list[list[int]]) -> list[np.ndarray]:
        """The pooled vectors of `inputs` (rows, not normalized), in order. Cancelling the caller
        drops its inputs that no batch has taken yet."""
        loop, warm = asyncio.get_running_loop(), in_warmup()
        items = [_Input(t, loop.create_future(), warm) for t in inputs]
        self._waiting.extend(items)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        try:
            return list(await asyncio.gather(*(i.future for i in items)))
        finally:
            for i in items:
                if not i.future.done():
                    i.future.cancel()  # not decoded yet: the runner skips it

    async def _run(self) -> None:
        while True:
            live = [i for i in self._waiting if not i.future.done()]  # a cancelled request's are left out
            if not live:
                self._waiting.clear()
                return
            n = pack([len(i.tokens) for i in live[:self.ctx.n_seq]], self.ctx.n_batch, self.ctx.n_seq)
            batch, self._waiting = live[:n], collections.deque(live[n:])
            try:
                rows = await self.worker.control(self.ctx.embed, [i.tokens for i in batch])
            except Exception as exc:  # llama.cpp refused the batch: its requests fail, the queue goes on
                log.error("embeddings batch of %d inputs of model %r failed: %s", len(batch), self.worker.name, exc)
                for i in batch:
                    if not i.future.done():
                        i.future.set_exception(BackendError(f"the embeddings batch failed: {exc}"))
                continue
            self._on_batch(self.worker.name, sum(not i.warm for i in batch))
            for i, row in zip(batch, rows):
                if not i.future.done():
                    i.future.set_result(row)


def _tokenize(queue: EmbedQueue, ask: EmbedAsk, max_token_bytes: int | None) -> list[list[int]]:
    """Each input's tokens (text as llama-server tokenizes it: BOS/EOS as the model adds them,
    special tokens parsed; token ids as given), each checked against the batch: on a thread."""
    ctx, model = queue.ctx, queue.worker.model
    out = []
    for i, item in enumerate(ask.inputs):
        if isinstance(item, str):
            check_prompt_bytes(len(item.encode("utf-8", "surrogatepass")), ctx.n_batch, max_token_bytes, f"input[{i}]")
            item = model.tokenize_prompt(item)
        ctx.check(item, i)
        out.append(item)
    return out


def _encode(row: np.ndarray, fmt: str) -> Any:
    import numpy as np

    return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else \
        np.asarray(row, dtype=np.float32).tolist()


async def _answer(queue: EmbedQueue, ask: EmbedAsk, metrics: Any) -> Response:
    import numpy as np

    m, worker = queue.worker.model, queue.worker
    worker.admit()  # a place in the model's queue, like a completion's: else 503, before any work
    try:
        tokens = await asyncio.to_thread(_tokenize, queue, ask, m.info.max_token_bytes)
        limit = None if in_warmup() else worker.request_timeout_s
        t0 = time.monotonic()
        try:  # as a generation: no request holds its model past request_timeout_s
            rows = await asyncio.wait_for(queue.embed(tokens), limit)
        except asyncio.TimeoutError:
            raise RequestError(f"the request held its model for {time.monotonic() - t0:.1f} s, longer than "
                               f"server.request_timeout_s = {limit:g} s allows ({len(tokens)} inputs): its inputs "
                               "not decoded yet were dropped", status=422, code="generation_timeout") from None
    finally:
        worker.release()
    vectors = finish(np.stack(rows), queue.ctx.cfg.normalize, ask.dimensions)
    n_tokens = sum(len(t) for t in tokens)
    metrics.embedded(m.cfg.name, len(tokens), n_tokens)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, ask.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": m.cfg.name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


def _queue_for(state: ServiceState, queues: dict[str, EmbedQueue], name: Any) -> EmbedQueue:
    """The named model's queue (else the first model with embeddings): 404 for a model not
    served, 400 for one served without an embeddings context."""
    if name is None and queues:
        return next(iter(queues.values()))
    worker = state.worker(name)  # 404 naming the models
    if worker.name not in queues:
        raise RequestError(f"model {worker.name!r} has no embeddings context: add [models.embeddings] (or "
                           f"embeddings = true) to its config; models with one: {sorted(queues)}",
                           param="model", code="model_not_supported")
    return queues[worker.name]


def embeddings_routes(state: ServiceState, guarded: Callable[[Request, Any], Awaitable[Response]]) -> list[Route]:
    """The route, and the queues of this app's models that have an embeddings context."""
    queues = {n: EmbedQueue(w, state.metrics.embed_batch) for n, w in state.workers.items()
              if w.model.embed is not None}

    async def handle(request: Request) -> Response:
        body = await json_body(request)
        queue = _queue_for(state, queues, body.get("model"))
        ctx = queue.ctx
        ask = parse_embeddings(body, EmbedLimits(ctx.n_embd, ctx.n_vocab, ctx.cfg.max_inputs, tuple(ctx.cfg.dimensions)))
        if ask.user:
            log.info("embeddings request from user %r", ask.user)
        return await _answer(queue, ask, state.metrics)

    async def embeddings(request: Request) -> Response:
        return await guarded(request, handle)

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]
