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
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.model.generate import Job
    from edge.model.sequence import Sink
    from edge.model.slots import Slots

__all__ = ["Scheduler"]

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

    # -- who uses it -----------------------------------------------------------------------------
    def attach(self) -> None:
        with self._cv:
            self._users += 1
            self._closing = False

    def detach(self) -> None:
        """A worker leaves; the last one's leaving ends the thread once its work is done."""
        with self._cv:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last:
            self.close()

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
        """A generation into the queue: it starts when it fits, its pieces to `sink`."""
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
                while not (self._calls or (not self.held and (slots.pending or (self._waiting and self._ready())))):
                    if self._closing:
                        self._thread = None  # a later call starts a new thread
                        return
                    self._cv.wait()
                calls, self._calls, held = self._calls, [], self.held
            for fn, args, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:
                        fut.set_exception(exc)
            if held:
                continue
            self._admit_waiting()
            try:
                slots.step()
            except BaseException as exc:  # a bug in a step: its sequences fail, the thread goes on
                slots.end_all(exc)

    def _ready(self) -> bool:
        job = self._waiting[0][0]
        return job.cancel.is_set() or self.slots.fits(job)

    def _admit_waiting(self) -> None:
        while True:
            with self._cv:  # held since the loop's turn began: what is queued stays queued
                if self.held or not self._waiting or not self._ready():
                    return
                job, sink, since = self._waiting.popleft()
            if job.cancel.is_set():  # a job whose client left while it was queued is not even prefilled
                sink.close(None)
                continue
            self.queue_wait_s += time.monotonic() - since
            self.started += 1
            self.slots.start(job, sink)

    def close(self) -> None:
        """Waits for the generations and calls queued, then ends the thread (a later call starts
        it again)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
