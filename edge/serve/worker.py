"""The workers: one thread per loaded model or engine.

Native contexts (llama.cpp, TensorRT, ONNX Runtime) are not thread-safe, so every call into one
runs on its own thread while the event loop stays free. A model's thread is its scheduler
(edge.model.scheduler), which decodes up to `parallel` requests at once (edge.model.slots); a
bounded queue turns overload into a clear 503 instead of unbounded latency.

At the drain's limit every worker is ended (`end`): a model's running sequences end at its next
step and its queued requests at once (its scheduler does it), each with the error the lifecycle
gives (a 503), and later ones are refused with it. A handover's old process passes its queued
requests on (`pass_on`): each one that has not started leaves the queue with `PassedOn`, and the
lifecycle hands its connection to the new process (edge.lifecycle.handover.pass_on).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from edge.errors import RequestError
from edge.serve.channel import Channel, merged

if TYPE_CHECKING:  # types only: importing the worker module stays free of the backends
    import numpy as np

    from edge.config import BatchingConfig
    from edge.engines.runtime import EngineSession
    from edge.engines.store import StoredEngine
    from edge.model.generate import Job, Piece
    from edge.model.llm import GGUFModel
    from edge.engines.dynamic_batching import Batcher
    from edge.model.slots import Slots

__all__ = ["SERVER_ENDED", "Worker", "ModelWorker", "EngineWorker", "PassedOn"]

SERVER_ENDED = "server_shutting_down"  # the error code of a request the drain's limit ended (a 503)


class PassedOn(Exception):
    """A request left this process's queue before it started, to be answered by another process
    (a handover's new one): nothing of it was sent, and it is not answered here."""


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

    def end(self, error: BaseException) -> threading.Event:
        """The drain's limit: what runs or waits here ends with `error`, and what comes later is
        refused with it (a 503; the process is leaving); the event is set once it has ended."""
        done = threading.Event()
        done.set()
        return done

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

    @property
    def passed_on(self) -> int:  # queued requests passed on by pass_on(), whichever worker queued them
        return self.scheduler.passed_on

    @property
    def passes_on(self) -> bool:
        """pass_on() was called: this process hands its queued requests to another."""
        return self.scheduler.passes_on

    def admit(self) -> None:
        """Take a place (a slot or the queue), or refuse with 503 -- before any response byte is sent."""
        ended = self.scheduler.ended
        if ended is not None:
            raise ended
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

    def end(self, error: BaseException) -> threading.Event:
        """Every running sequence of the model ends with `error` at its scheduler's next step (the
        one in progress finishes first: a decode cannot be cut), every queued request at once;
        later ones are refused with it (admit(), and any job that reaches the queue). The event
        is set once the scheduler has ended them (after the step in progress). The scheduler is
        the model's, shared by every worker on it: the drain's limit ends the whole process's."""
        return self.scheduler.end(error)

    def pass_on(self, error: BaseException) -> None:
        """Queued requests that no choice of has started leave the queue with `error` (PassedOn)
        at the scheduler's next turn, and so does every such request that comes later: a
        handover's old process, whose queue the new process takes over."""
        self.scheduler.pass_on(error)

    async def stream(self, job: Job, admitted: bool = False, eager: bool = True,
                     on_start: Callable[[], None] | None = None) -> AsyncIterator[Piece]:
        """Pieces of one generation; cancelling the consumer ends its sequence at the next step.
        `admitted`: the caller holds a place taken with admit() and releases it itself.
        `on_start`: called on the event loop when the job leaves the queue for a slot.
        `eager`: wake the event loop for the pieces it waits for (a stream: the first at once,
        then at most once per `stream_interval_s`, and the end); else only at the end (the
        first piece carries the time it was made, for the time-to-first-token metric).
        Pieces that came while the loop was busy arrive merged into one, so a slow consumer costs
        the scheduler nothing; the end of the channel is the end of the job."""
        if not admitted:
            self.admit()
        channel = Channel(asyncio.get_running_loop(), eager, self.stream_interval_s, on_start)
        try:
            self.scheduler.submit(job, channel)
            while True:
                pieces, end = await channel.get()
                if pieces:
                    yield merged(pieces)
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
        """This worker leaves its model's scheduler: the last to leave waits for the calls on its
        thread, then ends it; a generation still running then (nobody waits for it any more: the
        drain is over) ends at its next step."""
        self.scheduler.detach(RequestError(f"model {self.name!r} is closing", status=503, code=SERVER_ENDED))
        super().close()


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
        self._ended: BaseException | None = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.pending += 1  # queued or running: the queue depth that /metrics shows
        try:
            return await super().call(self._unless_ended, fn, *args)
        finally:
            self.pending -= 1

    def _unless_ended(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._ended is not None:  # queued behind the limit: not run (one running finishes: ms)
            raise self._ended
        return fn(*args)

    def end(self, error: BaseException) -> threading.Event:
        """Queued requests get `error` now; one running on the engine's thread finishes (ms)."""
        self._ended = error
        if self.batcher is not None:
            self.batcher.fail(error)
        return super().end(error)

    async def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's outputs: in a batch with whatever else is queued, or alone."""
        if self._ended is not None:
            raise self._ended
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
