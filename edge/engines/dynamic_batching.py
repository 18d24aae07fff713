"""Dynamic batching of one engine's KServe requests, as Triton's dynamic batcher does.

Requests that passed validation queue here; the engine's own thread takes the oldest one and
every later one whose inputs concatenate with it (the same non-batch dims of every input: the
same group), up to `max_batch_size` rows and within one optimization profile, concatenates them
(one copy-in, one execution for the batch) and splits the outputs back by rows. It waits for
company at most `max_queue_delay_us` after the oldest request arrived, and not at all once
`preferred_batch_size` rows of its group are queued; with no delay a batch is what queued while
the engine was busy, so a lone request never waits. Requests of other groups stay queued, in
order, for the next batch.

A request's own errors (shape, datatype, data) are found before it queues, so they never reach a
batch. A batch whose execution fails runs again one request at a time: a request that makes the
engine fail fails alone, with the engine's own error, and the others get their answers. A lost
GPU context fails every member at once (nothing more goes to the GPU). An engine whose outputs
turn out not to follow the batch (an output's first dim is not the batch's rows) stops batching
from then on, said once in the log; that batch's members run one at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge.config import BatchingConfig
from edge.engines.tensors import EngineSession, profile_for
from edge.errors import ConfigError, EngineError, GpuContextLost

__all__ = ["BATCH_SIZE_BUCKETS", "QUEUE_DELAY_BUCKETS", "Batcher", "BatchPolicy", "BatchStats",
           "batch_policy", "batch_rows"]

log = logging.getLogger("edge")

UNBOUNDED_ROWS = 64  # the cap of an engine whose batch dim no profile bounds (ONNX without profiles)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
QUEUE_DELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

Feeds = dict[str, np.ndarray]
Outcome = Any  # the outputs of one request (Feeds), or the exception it gets


@dataclass(frozen=True)
class BatchPolicy:
    max_rows: int
    preferred_rows: int
    delay_s: float


def batch_rows(session: EngineSession) -> tuple[int, str]:
    """The most rows one execution takes along a batch dimension (0 where there is none) and,
    for 0, why: every input and output has a dynamic first dim, and some profile takes more
    than one row for every input at once."""
    for kind, specs in (("input", session.inputs), ("output", session.outputs)):
        for t in specs:
            if not t.shape or t.shape[0] != -1:
                return 0, f"{kind} {t.name!r} has shape {t.shape}, whose first dim is not dynamic"
    if not session.profiles:
        return UNBOUNDED_ROWS, ""
    rows = max(min(r["max"][0] for r in prof.values()) if prof else 0 for prof in session.profiles)
    if rows <= 1:
        return 0, "no optimization profile takes more than one row for every input"
    return rows, ""


def batch_policy(session: EngineSession, cfg: BatchingConfig, source: str, where: str) -> BatchPolicy | None:
    """What `[engines.batching]` asks of this engine, checked against its profiles; None: one
    request at a time. A setting the engine cannot honour is a ConfigError naming the field."""
    if cfg.enabled is False:
        return None
    rows, why = batch_rows(session)
    if rows == 0:
        if cfg.enabled is True:
            raise ConfigError(source, f"{where}.enabled", f"the engine has no batch dimension ({why}); "
                              "set it to \"auto\" or false")
        return None
    for name in ("max_batch_size", "preferred_batch_size"):
        if getattr(cfg, name) > rows:
            raise ConfigError(source, f"{where}.{name}", f"expected at most {rows}, the most rows the "
                              f"engine's profiles take at once, found {getattr(cfg, name)}")
    most = cfg.max_batch_size or rows
    if cfg.preferred_batch_size > most:
        raise ConfigError(source, f"{where}.preferred_batch_size",
                          f"expected at most max_batch_size ({most}), found {cfg.preferred_batch_size}")
    return BatchPolicy(most, cfg.preferred_batch_size or most, cfg.max_queue_delay_us / 1e6)


class _Histogram:
    """Counts per upper bound (not cumulative) and the sum: what a Prometheus histogram exposes,
    kept here because the batcher outlives no app and is read at each scrape."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for b, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += c
            out.append((b, total))
        return out


@dataclass
class BatchStats:
    """Per engine, production traffic only (warm-up requests are left out): requests per
    execution, and each request's wait from its arrival here to its batch's execution."""

    batch_size: _Histogram = field(default_factory=lambda: _Histogram(BATCH_SIZE_BUCKETS))
    queue_delay: _Histogram = field(default_factory=lambda: _Histogram(QUEUE_DELAY_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Request:
    feeds: Feeds
    rows: int
    group: Hashable  # requests of one group concatenate along dim 0
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Feeds]
    warm: bool  # a warm-up request: kept out of the stats
    queued_at: float = field(default_factory=time.monotonic)


def _group_of(feeds: Feeds) -> tuple[int, Hashable]:
    """(rows, group): requests whose every input has the same dims after the first concatenate.
    One whose inputs disagree on their rows (or carry none) is a group of its own."""
    rows = {a.shape[0] if a.ndim else -1 for a in feeds.values()}
    if len(rows) != 1 or min(rows) < 1:
        return 0, object()
    return rows.pop(), tuple(sorted((n, a.shape[1:], a.dtype.str) for n, a in feeds.items()))


class _Unsplittable(Exception):
    """An output's first dim is not the batch's rows: the engine's first dim is no batch dim."""


def _split(outputs: Feeds, rows: list[int]) -> list[Feeds]:
    total, cuts = sum(rows), np.cumsum(rows)[:-1]
    for n, a in outputs.items():
        if a.ndim == 0 or a.shape[0] != total:
            raise _Unsplittable(f"output {n!r} has shape {list(a.shape)} for a batch of {total} rows")
    parts = {n: np.split(a, cuts) for n, a in outputs.items()}
    return [{n: parts[n][i] for n in outputs} for i in range(len(rows))]


class Batcher:
    """One engine's queue and its batches, run on the engine's thread through `submit`."""

    def __init__(self, name: str, session: EngineSession, policy: BatchPolicy,
                 submit: Callable[[Callable[[], None]], concurrent.futures.Future[None]]) -> None:
        self.name, self.policy, self.stats = name, policy, BatchStats()
        self.executions = 0  # every execution, warm-up included: what tests compare with requests
        self._session, self._profiles, self._submit = session, session.profiles, submit
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._draining = False  # a drain job is queued or running on the engine's thread
        self._closed = False
        self.enabled = True  # false once the engine's outputs proved not to follow the batch

    async def infer(self, feeds: Feeds, warm: bool = False) -> Feeds:
        """`warm`: a warm-up request, kept out of the stats (the caller knows; this floor has no HTTP)."""
        loop = asyncio.get_running_loop()
        rows, group = _group_of(feeds)
        req = _Request(feeds, rows, group, loop, loop.create_future(), warm)
        with self._cond:
            if self._closed:
                raise EngineError(f"engine {self.name!r} is closed")
            self._queue.append(req)
            start, self._draining = not self._draining, True
            self._cond.notify()
        if start:
            self._submit(self._drain)
        return await req.future

    def fail(self, error: BaseException) -> None:
        """No more requests, and every queued one gets `error` (the drain's limit); a batch on
        the engine's thread finishes."""
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify()
        _settle(queued, [copy.copy(error) for _ in queued])  # each its own: tracebacks differ

    def close(self) -> None:
        """No more requests; a drain waiting for company stops waiting."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _drain(self) -> None:  # the engine's thread: batches until the queue is empty
        while True:
            with self._cond:
                if not self._queue:
                    self._draining = False
                    return
                batch = self._take()
            try:
                self._execute(batch)
            except Exception as exc:  # never a request left waiting, whatever went wrong here
                log.exception("engine %s: a batch could not be run", self.name)
                _settle(batch, [EngineError(f"engine {self.name!r}: the batch failed: {exc}") for _ in batch])

    def _take(self) -> list[_Request]:
        """The next batch (lock held, queue not empty): the oldest request's group, once it is
        `preferred_rows` strong or the oldest has waited `delay_s`."""
        head = self._queue[0]
        deadline = head.queued_at + self.policy.delay_s
        while self.enabled and not self._closed and self._rows_of(head.group) < self.policy.preferred_rows:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        batch, rows = [head], head.rows
        for r in list(self._queue)[1:] if self.enabled and head.rows else []:
            if r.group != head.group or r.future.cancelled():
                continue
            if rows + r.rows > self.policy.max_rows or not self._fits(head, rows + r.rows):
                break  # in order: a later, smaller request does not overtake this one
            batch.append(r)
            rows += r.rows
        for r in batch:
            self._queue.remove(r)
        return batch

    def _rows_of(self, group: Hashable) -> int:
        return sum(r.rows for r in self._queue if r.group == group)

    def _fits(self, head: _Request, rows: int) -> bool:
        return profile_for(self._profiles, {n: (rows, *a.shape[1:]) for n, a in head.feeds.items()}) is not None

    def _execute(self, batch: list[_Request]) -> None:
        started = time.monotonic()
        self._record(batch, started)
        live = [r for r in batch if not r.future.cancelled()]  # a client that left gets no work
        outcomes: list[Outcome] = []
        if len(live) == 1:
            outcomes = [self._alone(live[0])]
        elif live:
            outcomes = self._together(live)
        _settle(live, outcomes)

    def _alone(self, req: _Request) -> Outcome:
        self.executions += 1
        try:
            return self._session.infer(req.feeds)
        except Exception as exc:  # the request's own answer: an error like any other
            return exc

    def _together(self, batch: list[_Request]) -> list[Outcome]:
        self.executions += 1
        try:
            return _split(self._stacked([r.feeds for r in batch]), [r.rows for r in batch])
        except GpuContextLost as exc:  # each member raises its own instance (tracebacks differ)
            return [GpuContextLost(str(exc)) for _ in batch]
        except _Unsplittable as exc:
            self.enabled = False
            log.warning("engine %s: batching turned off: %s (set [engines.batching] enabled = false)",
                        self.name, exc)
        except Exception as exc:
            log.warning("engine %s: a batch of %d requests failed (%s); each runs alone",
                        self.name, len(batch), exc)
        return [self._alone(r) for r in batch]

    def _stacked(self, parts: list[Feeds]) -> Feeds:
        """One execution of the requests stacked along dim 0: a session that stages rows itself
        (TensorRT: straight into its pinned buffers) gets them as they are, else one array each."""
        rows = getattr(self._session, "infer_rows", None)
        if rows is not None:
            return rows(parts)
        return self._session.infer({n: np.concatenate([p[n] for p in parts]) for n in parts[0]})

    def _record(self, batch: list[_Request], started: float) -> None:
        prod = [r for r in batch if not r.warm]
        if not prod:
            return
        with self.stats.lock:
            self.stats.batch_size.observe(len(batch))
            for r in prod:
                self.stats.queue_delay.observe(max(0.0, started - r.queued_at))


def _settle(batch: list[_Request], outcomes: list[Outcome]) -> None:
    """Each request's outcome handed to its event loop: one wake-up per loop per batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Feeds], Outcome]]] = {}
    for r, out in zip(batch, outcomes):
        by_loop.setdefault(r.loop, []).append((r.future, out))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, pairs)
        except RuntimeError:  # that loop has closed: nobody waits for these answers
            pass


def _resolve(pairs: list[tuple[asyncio.Future[Feeds], Outcome]]) -> None:
    for fut, out in pairs:
        if fut.done():  # cancelled: the client went away
            continue
        if isinstance(out, BaseException):
            fut.set_exception(out)
        else:
            fut.set_result(out)
