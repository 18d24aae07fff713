"""The workers: one thread per loaded model or engine.

Native contexts (llama.cpp, TensorRT, ONNX Runtime) are not thread-safe, so every call into one
runs on its own worker thread while the event loop stays free. A model's thread is a scheduler
that decodes up to `parallel` requests at once (edge.model.slots); a bounded queue turns overload
into a clear 503 instead of unbounded latency.

At the drain's limit every worker is ended (`end`): a model's running sequences end at its next
step and its queued requests at once, each with the error the lifecycle gives (a 503), and later
ones are refused with it. A handover's old process passes its queued requests on (`pass_on`):
each one that has not started leaves the queue with `PassedOn`, and the lifecycle hands its
connection to the new process (edge.lifecycle.handover.pass_on).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import threading
import time
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

log = logging.getLogger("edge")

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
    """One model's scheduler thread: every call into its llama.cpp context runs there. Requests'
    generations share the model's slots (edge.model.slots): one llama_decode per step for all of
    them; calls (tokenizing, thread counts, prefix states) run between steps. Admission: a free
    slot, else a place in the queue (`max_queue` beyond the slots), else 503."""

    def __init__(self, model: GGUFModel, max_queue: int, stream_interval_s: float = 0.0,
                 request_timeout_s: float | None = None) -> None:
        super().__init__(model.cfg.name)
        self.model = model
        self.max_queue = max_queue
        self.stream_interval_s = stream_interval_s  # a stream's events: at most one per interval
        self.request_timeout_s = request_timeout_s  # how long one request may hold the model (None: no limit)
        self._cv = threading.Condition()
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]] = []
        self._waiting: collections.deque[tuple[Job, Channel, float]] = collections.deque()
        self._closing = False
        self._held = False  # admitted requests wait: no step runs (a handover's new process, see hold())
        self._ended: BaseException | None = None  # end(): every sequence ends with it, at the next step
        self._ended_all = threading.Event()  # the scheduler has ended them
        self._passing: BaseException | None = None  # pass_on(): queued requests leave with it
        self.passed_on = 0  # queued requests passed on by pass_on()
        self._thread: threading.Thread | None = None
        self.queue_wait_s = 0.0  # summed over started generations: time between submission and a slot
        self.started = 0
        self.arrivals = 0  # client requests admitted (warm-up's own not counted)
        self.on_arrival: Callable[[], None] | None = None  # called at each (calibration after READY)

    @property
    def slots(self) -> Slots:
        return self.model.slots

    def admit(self) -> None:
        """Take a place (a slot or the queue), or refuse with 503 -- before any response byte is sent."""
        if self._ended is not None:
            raise self._ended
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
        return await asyncio.wrap_future(self._submit(fn, args))

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the model's thread, from a thread that may block (a load, a drain)."""
        return self._submit(fn, args).result()

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, args, fut))
            self._start()
            self._cv.notify()
        return fut

    def _start(self) -> None:
        if self._thread is None:  # the first call or job starts it (held: self._cv)
            self._thread = threading.Thread(target=self._loop, name=f"edge-{self.name}", daemon=True)
            self._thread.start()

    def hold(self) -> None:
        """Requests are admitted and queued but no step runs until `resume()`: a handover's new
        process, while the old one still decodes its last requests on the same cores."""
        with self._cv:
            self._held = True

    def resume(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify()

    def end(self, error: BaseException) -> threading.Event:
        """Every running sequence ends with `error` at the scheduler's next step (the one in
        progress finishes first: a decode cannot be cut), every queued request at once; later
        ones are refused with it (admit(), and any job that reaches the queue). The event is set
        once the scheduler has ended them (after the step in progress)."""
        with self._cv:
            self._ended = error
            if self._thread is None:
                self._ended_all.set()
            self._cv.notify()
        return self._ended_all

    def pass_on(self, error: BaseException) -> None:
        """Queued requests that no choice of has started leave the queue with `error` (PassedOn)
        at the scheduler's next turn, and so does every such request that comes later: a
        handover's old process, whose queue the new process takes over."""
        with self._cv:
            self._passing = error
            self._cv.notify()

    def _loop(self) -> None:
        """The scheduler: calls between steps, free slots filled from the queue, one step."""
        slots = self.slots
        while True:
            with self._cv:
                while not (self._calls or self._due(slots)):
                    if self._closing:
                        return
                    self._cv.wait()
                calls, self._calls, held, ended = self._calls, [], self._held, self._ended
            for fn, args, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:
                        fut.set_exception(exc)
            if ended is not None:  # once per step: what runs or waits ends here, before the batch
                self._end_all(slots, ended)
                self._ended_all.set()
            if held:
                continue
            self._admit_waiting(slots)
            try:
                slots.step()
            except BaseException as exc:  # a bug in a step: its sequences fail, the thread goes on
                slots.end_all(exc)

    @property
    def passes_on(self) -> bool:
        """pass_on() was called: this process hands its queued requests to another."""
        return self._passing is not None

    def _due(self, slots: Slots) -> bool:
        """Whether the scheduler has work (held: self._cv)."""
        if self._ended is not None and (slots.busy or self._waiting or not self._ended_all.is_set()):
            return True
        return not self._held and bool(slots.busy or (self._waiting and self._ready(slots)))

    def _ready(self, slots: Slots) -> bool:
        job = self._waiting[0][0]
        return job.cancel.is_set() or self._passes(job) or slots.fits(job)

    def _passes(self, job: Job) -> bool:
        # a request whose choice started here stays (its answer has begun); `hold` is the request's
        return self._passing is not None and job.hold.since is None

    def _end_all(self, slots: Slots, error: BaseException) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        running = slots.busy
        for _, channel, _ in waiting:
            channel.close(copy.copy(error))  # each its own: each is raised in its own request
        slots.end_all(error)
        if running or waiting:
            log.warning("model %r: %d running and %d queued generations ended by the server: %s", self.name,
                        running, len(waiting), error)

    def _pass_queued(self) -> None:
        with self._cv:
            passed = [w for w in self._waiting if self._passes(w[0]) and not w[0].cancel.is_set()]
            for w in passed:
                self._waiting.remove(w)
        for _, channel, _ in passed:
            channel.close(self._passing)
        self.passed_on += len(passed)

    def _admit_waiting(self, slots: Slots) -> None:
        if self._ended is not None:  # nothing starts after the limit: the next turn ends what waits
            return
        if self._passing is not None:
            self._pass_queued()
        while True:
            with self._cv:
                if not self._waiting or not self._ready(slots):
                    return
                job, channel, since = self._waiting.popleft()
            if job.cancel.is_set():  # a job whose client left while it was queued is not even prefilled
                channel.close(None)
                continue
            if self._passes(job):  # came after pass_on()
                channel.close(self._passing)
                self.passed_on += 1
                continue
            self.queue_wait_s += time.monotonic() - since
            self.started += 1
            channel.started()
            slots.start(job, channel)

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
            with self._cv:
                self._waiting.append((job, channel, time.monotonic()))
                self._start()
                self._cv.notify()
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
            with self._cv:
                self._cv.notify()  # the scheduler may be idle: the sequence ends now
            if not admitted:
                self.release()

    def close(self) -> None:
        """Waits for the calls on its thread, then ends it; a generation still running (nobody
        waits for it any more: the drain is over) ends at its next step."""
        with self._cv:
            self._closing = True
            if self._ended is None:
                self._ended = RequestError(f"model {self.name!r} is closing", status=503, code=SERVER_ENDED)
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
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
