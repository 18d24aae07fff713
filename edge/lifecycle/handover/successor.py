"""A handover's new process (edge.lifecycle.handover.handover has the old one's side): what its start
is given once (`Takeover`), the pipe it says "ready" on, its notifier until then, the hold on its
models until the old process has drained, and the connections the old process passes on to it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge.lifecycle.handover.pass_on import PASS_ON_ENV
from edge.lifecycle.systemd import DRAINED_ENV, HANDOVER_ENV, Notifier

if TYPE_CHECKING:
    from edge.lifecycle.handover.priority import Yielded
    from edge.serve.worker import ModelWorker

__all__ = ["HOLD_AT_MOST_S", "Successor", "SuccessorNotifier", "Takeover"]

# How long a new process's models wait at most for the old process's drain: its last requests of
# a few tokens end within a second or so; a long stream there (a drain can last drain_timeout_s)
# must not hold every new request that long, so after this the two decode side by side.
HOLD_AT_MOST_S = 2.0

log = logging.getLogger("edge")


class Successor:
    """The pipe to the process this one takes over from (EDGE_HANDOVER_FD, taken out of the
    environment so that nothing this process starts inherits it)."""

    def __init__(self, fd: int, drained_fd: int | None = None, channel_fd: int | None = None) -> None:
        self.fd = fd
        os.set_inheritable(fd, False)
        self.drained_fd = drained_fd  # EOF once the old process has drained (or is gone)
        if drained_fd is not None:
            os.set_inheritable(drained_fd, False)
        # the connections the old process passes on (edge.lifecycle.handover.pass_on)
        self.channel = socket.socket(fileno=channel_fd) if channel_fd is not None else None
        if self.channel is not None:
            self.channel.set_inheritable(False)

    @classmethod
    def from_env(cls) -> "Successor | None":
        raw, drained = os.environ.pop(HANDOVER_ENV, None), os.environ.pop(DRAINED_ENV, None)
        channel = os.environ.pop(PASS_ON_ENV, None)
        try:
            return cls(int(raw), int(drained) if drained else None, int(channel) if channel else None) if raw else None
        except (ValueError, OSError):
            log.warning("%s=%r is not an open file descriptor: starting as a plain start", HANDOVER_ENV, raw)
            return None

    def take_connections(self, server: Any) -> None:
        """The requests the old process passes on at the switch, with their connections, served by
        `server` (uvicorn's, serving) as if it had accepted them (edge.lifecycle.handover.pass_on)."""
        if self.channel is None:
            return
        import asyncio
        from functools import partial

        from edge.lifecycle.handover.pass_on import adopt, receive_connections

        channel, self.channel = self.channel, None
        receive_connections(channel, asyncio.get_running_loop(), partial(adopt, server))

    def hold_until_drained(self, models: list[ModelWorker], limit_s: float) -> None:
        """The models hold their requests (queued, not decoded) until the old process has drained,
        at most `limit_s` (HOLD_AT_MOST_S, or the drain limit if shorter): two processes decoding on the same cores at once
        slow each other far more than their share (ggml's threads spin at their barriers), so the
        requests that come at the switch wait for the old process's last ones instead. A
        thread waits for the pipe's EOF, which comes when the old process closes its end after
        its drain, or when it ends whatever way."""
        if self.drained_fd is None:
            return
        import select
        import threading
        import time

        for w in models:
            w.hold()
        fd, self.drained_fd = self.drained_fd, None
        t0 = time.monotonic()

        def wait() -> None:
            try:
                ready, _, _ = select.select([fd], [], [], limit_s)
                waited = time.monotonic() - t0
                if ready:
                    log.info("handover: the old process drained in %.3f s; decoding", waited)
                else:
                    log.warning("handover: the old process did not drain in %.1f s; decoding beside it", waited)
            finally:
                os.close(fd)
                for w in models:
                    w.resume()

        threading.Thread(target=wait, name="edge-drained", daemon=True).start()

    def announce(self, status: str) -> None:
        """Ready: the status line for systemd, sent by the old process with MAINPID=."""
        try:
            os.write(self.fd, json.dumps({"ready": True, "pid": os.getpid(), "status": status}).encode() + b"\n")
        except OSError as exc:  # the old process is gone: there is no one to hand over from
            log.warning("handover: the old process does not listen any more (%s)", exc)
        finally:
            os.close(self.fd)


class SuccessorNotifier(Notifier):
    """A new process's notifier: until it is ready, nothing it says may end the old process's
    reload or stop the service (no READY=1, no STOPPING=1): its READY goes to the old process.
    Once ready it is the service's notifier like any other."""

    def __init__(self, successor: Successor) -> None:
        super().__init__()
        self.successor: Successor | None = successor

    def ready(self, text: str) -> bool:
        if self.successor is None:
            return super().ready(text)
        self.stop_extending()
        log.info("%s (handing over)", text)
        successor, self.successor = self.successor, None
        successor.announce(text)
        return True

    def stopping(self, text: str = "draining in-flight requests") -> bool:
        if self.successor is None:
            return super().stopping(text)
        log.info("stopping before the handover: %s", text)
        return False


@dataclass
class Takeover:
    """A start by a running edge, to take over from it (its environment named the handover pipe),
    given once to the start (edge.lifecycle.start.ColdStart): the pipe to the old process
    (`successor`; None where the environment's was no open descriptor: then it starts as a plain
    start) and this process's CPU priority, lowered until it serves (`yielded`; None where it could
    not be taken back, so was never lowered)."""

    successor: Successor | None
    yielded: Yielded | None

    @classmethod
    def from_env(cls, yielded: Yielded | None) -> Takeover:
        return cls(Successor.from_env(), yielded)

    @property
    def takes_over(self) -> bool:
        return self.successor is not None

    def notifier(self) -> Notifier:
        """Until ready, its READY goes to the old process (SuccessorNotifier); a plain one else."""
        return SuccessorNotifier(self.successor) if self.successor is not None else Notifier()

    def before_serving(self, models: list[ModelWorker], drain_timeout_s: float) -> None:
        """Just before READY: every thread back to the service's priority, and the models holding
        their requests until the old process has drained (at most HOLD_AT_MOST_S, or the drain
        limit if shorter)."""
        if self.yielded is not None:
            self.yielded.restore()
        if self.successor is not None:
            self.successor.hold_until_drained(models, min(HOLD_AT_MOST_S, drain_timeout_s))

    def take_connections(self, server: Any) -> None:
        """Serving (`server`, uvicorn's): the connections the old process passes on are served here."""
        if self.successor is not None:
            self.successor.take_connections(server)

    def report(self) -> dict[str, Any]:
        """What the start report says of it: the priority it started at and took back."""
        return {"priority": self.yielded.as_dict()} if self.yielded is not None else {}
