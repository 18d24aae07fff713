"""What SIGTERM, SIGINT and SIGHUP do to a start before uvicorn takes the signals over at READY.

Until the event loop runs, SIGTERM raises StoppedDuringStart wherever the start is (the load: the
start ends, its report says "stopped", exit 0) and SIGHUP is noted, to reload once serving (the
config may have changed since it was read). Once the loop runs the warm-up, a signal only sets an
event the loop delivers: raised inside whatever the loop runs, it would fail a warm-up request
(exit 70) or break a lock (hang); the warm-up is cancelled then, and a signal after the warm-up
drains the service as soon as it serves.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from edge.errors import StoppedDuringStart

if TYPE_CHECKING:
    import asyncio

__all__ = ["StartSignals"]

log = logging.getLogger("edge")


class StartSignals:
    """A start's signals before READY; `hup_pending`: a SIGHUP came, reload once serving."""

    def __init__(self) -> None:
        self.hup_pending = False

    def install(self) -> None:
        """Before the load: SIGTERM stops the start where it is, SIGHUP is noted."""
        signal.signal(signal.SIGTERM, _stop_during_start)
        signal.signal(signal.SIGHUP, self._hup)

    def _hup(self, sig: int, frame: Any) -> None:
        log.info("SIGHUP during the start: reloading once ready")
        self.hup_pending = True

    async def unless_stopped(self, warm: Awaitable[None]) -> asyncio.Event:
        """`warm` run on the loop, given up at SIGTERM/SIGINT (StoppedDuringStart); the event a
        later signal sets, for the start to drain at once when it serves."""
        import asyncio  # not with this module: a start imports it before its config

        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        warming = asyncio.ensure_future(warm)
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({warming, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            stopped.cancel()
            warming.result()  # the warm-up's own error, if any
            return stop
        warming.cancel()
        await asyncio.wait({warming})
        raise StoppedDuringStart("SIGTERM during warm-up")


def _stop_during_start(sig: int, frame: Any) -> None:
    raise StoppedDuringStart("SIGTERM before ready")
