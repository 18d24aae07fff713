"""One model's scheduler thread: every call into its llama.cpp context runs there.

A llama.cpp context is not thread-safe, and its slots (edge.model.slots) are one set of
sequences: so a loaded model has exactly one scheduler, made with it, whoever serves it. The
workers that put requests on a model (edge.serve.worker.ModelWorker: a start's, then a reload's
that keeps the model, or two in a test one after the other) share it; none of them can step the
slots from a thread of its own, so a worker made while an earlier one still drains hands
nothing over: their sequences are decoded in the same steps, with ids from one set of slots.

The loop: calls (tokenizing, thread counts, prefix states) run between steps; queued generations
start in the order they came when they fit (edge.model.admission); one step. Held (a
handover's new process, while the old one still decodes on the same cores): requests are queued
and calls run, no step does.

The end (issue 57): at the drain's limit (`end`) every running sequence ends at the next step
(the one in progress finishes: a decode cannot be cut) and every queued request at once, each
with the error the lifecycle gives (a 503), and every request submitted later too. The last
worker leaving (`close`) ends what still runs the same way: nobody waits for it any more. A
handover's old process passes its queue on (`pass_on`): each queued request that has not
started leaves with the error given (the serve layer hands its connection to the new process).
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.model.generate import Job
    from edge.model.sequence import Sink
    from edge.model.slots import Slots

__all__ = ["Scheduler"]

log = logging.getLogger("edge")

Call = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any]"]


class Scheduler:
    def __init__(self, slots: Slots, name: str) -> None:
        self.slots, self.name = slots, name
        self._cv = threading.Condition()
        self._calls: list[Call] = []
        self._waiting: collections.deque[tuple[Job, Sink, float]] = collections.deque()
        self._users = 0  # workers attached (edge.serve.worker): the thread ends when the last leaves
        self._closing = False
        self.held = False  # admitted requests wait: no step runs (hold())
        self._thread: threading.Thread | None = None
        self.queue_wait_s = 0.0  # summed over started generations: time between submission and a slot
        self.started = 0
        self._ended: BaseException | None = None  # end(): every sequence ends with it, at the next step
        self._ended_all = threading.Event()  # the thread has ended them
        self._passing: BaseException | None = None  # pass_on(): queued requests leave with it
        self.passed_on = 0  # queued requests passed on by pass_on()

    # -- who uses it -----------------------------------------------------------------------------
    def attach(self) -> None:
        with self._cv:
            if self._users == 0 and self._thread is None:  # a new life for a model all had left: not ended
                self._ended, self._passing = None, None
                self._ended_all.clear()
            self._users += 1
            self._closing = False

    def detach(self, error: BaseException | None = None) -> None:
        """A worker leaves; the last one's leaving ends the thread once its calls are done, what
        still runs ending with `error` at the next step (None: it runs to its end first)."""
        with self._cv:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last:
            self.close(error)

    # -- work ------------------------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        """`fn(*args)` on the thread, between steps."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, args, fut))
            self._start()
            self._cv.notify()
        return fut

    def submit(self, job: Job, sink: Sink) -> None:
        """A generation into the queue: it starts when it fits, its pieces to `sink` (after end():
        it ends at the thread's next turn, as every queued one)."""
        with self._cv:
            self._waiting.append((job, sink, time.monotonic()))
            self._start()
            self._cv.notify()

    def wake(self) -> None:
        """Something changed that the loop may be waiting for (a job was cancelled)."""
        with self._cv:
            self._cv.notify()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def hold(self) -> None:
        """Requests are queued but no step runs until `resume()`."""
        with self._cv:
            self.held = True

    def resume(self) -> None:
        with self._cv:
            self.held = False
            self._cv.notify()

    @property
    def ended(self) -> BaseException | None:
        """The error end() was given: what every request ends with from then on."""
        return self._ended

    def end(self, error: BaseException) -> threading.Event:
        """Every running sequence ends with `error` at the next step (the one in progress finishes
        first: a decode cannot be cut), every queued request at once, every later one too. The
        event is set once the thread has ended them (after the step in progress)."""
        with self._cv:
            self._ended = error
            if self._thread is None:
                self._ended_all.set()
            self._cv.notify()
        return self._ended_all

    def pass_on(self, error: BaseException) -> None:
        """Queued requests that have not started leave the queue with `error` at the thread's
        next turn, and so does every such request submitted later: a handover's old process,
        whose queue the new process takes over."""
        with self._cv:
            self._passing = error
            self._cv.notify()

    @property
    def passes_on(self) -> bool:
        """pass_on() was called: this process hands its queued requests to another."""
        return self._passing is not None

    def _start(self) -> None:
        if self._thread is None:  # the first call or job starts it (held: self._cv)
            self._thread = threading.Thread(target=self._loop, name=f"edge-{self.name}", daemon=True)
            self._thread.start()

    # -- the thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Calls between steps, free slots filled from the queue, one step."""
        slots = self.slots
        while True:
            with self._cv:
                while not (self._calls or self._due()):
                    if self._closing:
                        self._thread = None  # a later call starts a new thread
                        return
                    self._cv.wait()
                calls, self._calls, held, ended = self._calls, [], self.held, self._ended
            for fn, args, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:
                        fut.set_exception(exc)
            if ended is not None:  # once per turn: what runs or waits ends here, before the batch
                self._end_all(ended)
                self._ended_all.set()
            if held:
                continue
            self._admit_waiting()
            try:
                slots.step()
            except BaseException as exc:  # a bug in a step: its sequences fail, the thread goes on
                slots.end_all(exc)

    def _due(self) -> bool:
        """Whether the thread has work besides calls (held: self._cv)."""
        slots = self.slots
        if self._ended is not None and (slots.pending or self._waiting or not self._ended_all.is_set()):
            return True
        return not self.held and bool(slots.pending or (self._waiting and self._ready()))

    def _ready(self) -> bool:
        job = self._waiting[0][0]
        return job.cancel.is_set() or self._passes(job) or self.slots.fits(job)

    def _passes(self, job: Job) -> bool:
        # a request one of whose choices started here stays (its answer has begun): its hold's clock runs
        return self._passing is not None and job.hold.since is None

    def _end_all(self, error: BaseException) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        running = self.slots.pending
        for _, sink, _ in waiting:
            sink.close(copy.copy(error))  # each its own: each is raised in its own request
        self.slots.end_all(error)
        if running or waiting:
            log.warning("model %r: %d running and %d queued generations ended by the server: %s", self.name,
                        running, len(waiting), error)

    def _pass_queued(self) -> None:
        with self._cv:
            passed = [w for w in self._waiting if self._passes(w[0]) and not w[0].cancel.is_set()]
            for w in passed:
                self._waiting.remove(w)
        for _, sink, _ in passed:
            sink.close(self._passing)
        self.passed_on += len(passed)

    def _admit_waiting(self) -> None:
        if self._ended is not None:  # nothing starts after the limit: the next turn ends what waits
            return
        if self._passing is not None:
            self._pass_queued()
        while True:
            with self._cv:  # held since the loop's turn began: what is queued stays queued
                if self.held or not self._waiting or not self._ready():
                    return
                job, sink, since = self._waiting.popleft()
            if job.cancel.is_set():  # a job whose client left while it was queued is not even prefilled
                sink.close(None)
                continue
            if self._passes(job):  # came after pass_on()
                sink.close(self._passing)
                self.passed_on += 1
                continue
            self.queue_wait_s += time.monotonic() - since
            self.started += 1
            sink.started()
            self.slots.start(job, sink)

    def close(self, error: BaseException | None = None) -> None:
        """Waits for the calls queued, then ends the thread (a later call starts it again); what
        still runs ends with `error` at the next step (None: the generations run to their end
        first)."""
        with self._cv:
            self._closing = True
            if error is not None and self._ended is None:
                self._ended = error
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
