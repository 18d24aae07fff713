"""The workers: one thread per loaded model or engine.

Native contexts (llama.cpp, TensorRT, ONNX Runtime) are not thread-safe, so every call into one
runs on its own thread while the event loop stays free. A model's thread is its scheduler
(edge.model.scheduler), which decodes up to `parallel` requests at once (edge.model.slots); a
bounded queue turns overload into a clear 503 instead of unbounded latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from edge.errors import RequestError

if TYPE_CHECKING:  # types only: importing the worker module stays free of the backends
    import numpy as np

    from edge.config import BatchingConfig
    from edge.engines.runtime import EngineSession
    from edge.engines.store import StoredEngine
    from edge.model.generate import Job, Piece
    from edge.model.llm import GGUFModel
    from edge.engines.dynamic_batching import Batcher
    from edge.model.slots import Slots

__all__ = ["Worker", "ModelWorker", "EngineWorker"]


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"edge-{name}")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the worker's thread, from a thread that may block (a load, a drain)."""
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ModelWorker(Worker):
    """Requests onto one model: admission (a place among its slots and `max_queue`, else 503)
    and each generation's stream. Every call into the model's llama.cpp context runs on the
    model's one scheduler thread (edge.model.scheduler), which every worker on that model shares:
    a reload that keeps the model keeps its worker, and a second worker on a model an earlier
    one still drains decodes in the same steps, never beside them."""

    def __init__(self, model: GGUFModel, max_queue: int, stream_interval_s: float = 0.0,
                 request_timeout_s: float | None = None) -> None:
        super().__init__(model.cfg.name)
        self.model = model
        self.max_queue = max_queue
        self.stream_interval_s = stream_interval_s  # a stream's events: at most one per interval
        self.request_timeout_s = request_timeout_s  # how long one request may hold the model (None: no limit)
        self.scheduler = model.scheduler
        self.scheduler.attach()
        self.arrivals = 0  # client requests admitted (warm-up's own not counted)
        self.on_arrival: Callable[[], None] | None = None  # called at each (calibration after READY)

    @property
    def slots(self) -> Slots:
        return self.model.slots

    @property
    def queue_wait_s(self) -> float:  # /metrics: the model's, whichever worker queued them
        return self.scheduler.queue_wait_s

    @property
    def started(self) -> int:
        return self.scheduler.started

    @property
    def _held(self) -> bool:
        return self.scheduler.held

    def admit(self) -> None:
        """Take a place (a slot or the queue), or refuse with 503 -- before any response byte is sent."""
        limit = self.slots.n + self.max_queue
        if self.pending >= limit:
            raise RequestError(f"model {self.model.cfg.name!r} has {self.pending} requests running or queued "
                               f"({self.slots.n} slots, max_queue = {self.max_queue}); retry later",
                               status=503, code="server_busy")
        self.pending += 1
        from edge.serve.warmscope import in_warmup  # imported with the app already: a dict lookup

        if not in_warmup():
            self.arrivals += 1
            if self.on_arrival is not None:
                self.on_arrival()

    def release(self) -> None:
        self.pending -= 1

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A call on the model's thread (tokenizing a request) takes a place in the same bounded
        queue as generations: a flood of long prompts is a 503, not a wait for everyone."""
        self.admit()
        try:
            return await self.control(fn, *args)
        finally:
            self.release()

    async def control(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A call on the model's thread that is no request (thread counts during a reload): it
        neither waits for nor counts in the request queue's bound, so a full queue cannot
        refuse it."""
        return await asyncio.wrap_future(self.scheduler.call(fn, args))

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the model's thread, from a thread that may block (a load, a drain)."""
        return self.scheduler.call(fn, args).result()

    def hold(self) -> None:
        """Requests are admitted and queued but no step runs until `resume()`: a handover's new
        process, while the old one still decodes its last requests on the same cores."""
        self.scheduler.hold()

    def resume(self) -> None:
        self.scheduler.resume()

    async def stream(self, job: Job, admitted: bool = False, eager: bool = True) -> AsyncIterator[Piece]:
        """Pieces of one generation; cancelling the consumer ends its sequence at the next step.
        `admitted`: the caller holds a place taken with admit() and releases it itself.
        `eager`: wake the event loop for the pieces it waits for (a stream: the first at once,
        then at most once per `stream_interval_s`, and the end); else only at the end (the
        first piece carries the time it was made, for the time-to-first-token metric).
        Pieces that came while the loop was busy arrive merged into one, so a slow consumer costs
        the scheduler nothing; the end of the channel is the end of the job."""
        if not admitted:
            self.admit()
        channel = _Channel(asyncio.get_running_loop(), eager, self.stream_interval_s)
        try:
            self.scheduler.submit(job, channel)
            while True:
                pieces, end = await channel.get()
                if pieces:
                    yield _merged(pieces)
                if end is not None:
                    if isinstance(end, BaseException):
                        raise end
                    break
        finally:
            job.cancel.set()
            self.scheduler.wake()  # the scheduler may be idle: the sequence ends now
            if not admitted:
                self.release()

    def close(self) -> None:
        """This worker leaves its model's scheduler: the last to leave waits for the generations
        and calls on its thread, then ends it."""
        self.scheduler.detach()
        super().close()


_DONE = True  # what _Channel.get returns as `end` once the generation finished without error


class _Channel:
    """Pieces from the worker thread to the event loop. The thread never blocks; it schedules a
    wake-up of the loop only when the loop waits for one (eager: the first piece, then at most one
    per interval; else the end), so at most one wake-up is in flight whatever the token rate. On
    2 cores every wake-up of the loop takes a core from llama.cpp's threads mid-decode."""

    def __init__(self, loop: asyncio.AbstractEventLoop, eager: bool, interval_s: float = 0.0) -> None:
        self._loop, self._eager, self._interval = loop, eager, interval_s
        self._next_wake = 0.0  # monotonic: an eager channel wakes the loop at most this often
        self._lock = threading.Lock()
        self._items: list[Piece] = []
        self._end: BaseException | bool | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._first = True

    def put(self, piece: Piece) -> None:  # the worker thread
        if self._first:
            piece.at, self._first = time.perf_counter(), False
        now = time.monotonic() if self._eager else 0.0
        with self._lock:
            self._items.append(piece)
            wake = self._waiter if self._eager and now >= self._next_wake else None
            if wake is not None:
                self._waiter, self._next_wake = None, now + self._interval
        if wake is not None:
            self._loop.call_soon_threadsafe(_wake, wake)

    def close(self, error: BaseException | None) -> None:  # the worker thread
        with self._lock:
            self._end = error if error is not None else _DONE
            wake, self._waiter = self._waiter, None
        if wake is not None:
            self._loop.call_soon_threadsafe(_wake, wake)

    async def get(self) -> tuple[list[Piece], BaseException | bool | None]:
        """What came since the last call (and the end, once there): waits while there is none."""
        while True:
            with self._lock:
                if self._items or self._end is not None:
                    items, self._items = self._items, []
                    return items, self._end
                waiter = self._waiter = self._loop.create_future()
            await waiter


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _merged(pieces: list[Piece]) -> Piece:
    if len(pieces) == 1:
        return pieces[0]
    from edge.model.generate import Piece

    return Piece("".join(p.text for p in pieces), pieces[-1].finish_reason,
                 [lp for p in pieces for lp in p.logprobs], at=pieces[0].at)


class EngineWorker(Worker):
    """One engine's thread: its session is created, called and closed there (a CUDA context is
    current per thread). Requests go through `infer`: batched (edge.engines.dynamic_batching) where the
    engine has a batch dimension and `[engines.batching]` allows it, else one at a time."""

    session: EngineSession

    def __init__(self, name: str, stored: StoredEngine, batching: BatchingConfig | None = None) -> None:
        super().__init__(name)
        self.stored = stored
        self.batching = batching
        self.batcher: Batcher | None = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.pending += 1  # queued or running: the queue depth that /metrics shows
        try:
            return await super().call(fn, *args)
        finally:
            self.pending -= 1

    async def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's outputs: in a batch with whatever else is queued, or alone."""
        if self.batcher is None or not self.batcher.enabled:
            return await self.call(self.session.infer, feeds)
        self.pending += 1
        try:
            from edge.serve.warmscope import in_warmup  # imported with the app already

            return await self.batcher.infer(feeds, in_warmup())
        finally:
            self.pending -= 1

    def open(self, data: bytes, make: Callable[[StoredEngine, bytes], EngineSession] | None = None,
             where: tuple[str, str] = ("<config>", "engines[0].batching")) -> EngineSession:
        """The session, made on the engine's thread; then its batcher, where `self.batching`
        asks for one (`where`: the config file and the table, named by a setting the engine's
        profiles cannot honour)."""
        if make is None:
            from edge.engines.runtime import session_from_engine as make

        self.session = self._pool.submit(make, self.stored, data).result()
        if self.batching is not None:
            from edge.engines.dynamic_batching import Batcher, batch_policy

            policy = batch_policy(self.session, self.batching, *where)
            if policy is not None:
                self.batcher = Batcher(self.name, self.session, policy, self._pool.submit)
        return self.session

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()  # a drain waiting for company runs what it holds now
        session = getattr(self, "session", None)
        if session is not None:
            self._pool.submit(session.close).result()  # GPU objects go on the thread that made them
        super().close()
