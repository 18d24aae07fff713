"""Pieces of one generation from a model's scheduler thread (edge.serve.worker) to the event loop
that answers its request: the thread never blocks on the loop, and wakes it only when it waits for
something (`Channel`); pieces that came while the loop was busy are handed over merged (`merged`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.model.generate import Piece

__all__ = ["Channel", "merged"]


_DONE = True  # what Channel.get returns as `end` once the generation finished without error


class Channel:
    """Pieces from the worker thread to the event loop. The thread never blocks; it schedules a
    wake-up of the loop only when the loop waits for one (eager: the first piece, then at most one
    per interval; else the end), so at most one wake-up is in flight whatever the token rate. On
    2 cores every wake-up of the loop takes a core from llama.cpp's threads mid-decode."""

    def __init__(self, loop: asyncio.AbstractEventLoop, eager: bool, interval_s: float = 0.0,
                 on_start: Callable[[], None] | None = None) -> None:
        self._loop, self._eager, self._interval, self._on_start = loop, eager, interval_s, on_start
        self._next_wake = 0.0  # monotonic: an eager channel wakes the loop at most this often
        self._lock = threading.Lock()
        self._items: list[Piece] = []
        self._end: BaseException | bool | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._first = True

    def started(self) -> None:  # the worker thread: the job leaves the queue for a slot
        if self._on_start is not None:
            self._loop.call_soon_threadsafe(self._on_start)

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


def merged(pieces: list[Piece]) -> Piece:
    if len(pieces) == 1:
        return pieces[0]
    from edge.model.generate import Piece

    return Piece("".join(p.text for p in pieces), pieces[-1].finish_reason,
                 [lp for p in pieces for lp in p.logprobs], at=pieces[0].at)
