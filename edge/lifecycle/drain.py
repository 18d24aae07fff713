"""The drain after SIGTERM (or a lost GPU, or a handover's switch): stop accepting, let every
connection finish without a client seeing a reset, then let uvicorn shut down (`Drain`); every
response from then on says `Connection: close` (`close_when_draining`); and `leave`, a set that
can serve no more ending the service through the same drain.

At the drain's limit (`drain_timeout_s`) edge ends what still runs itself (`Drain.on_limit`: every
sequence at its model's next step, with a 503 or a stream's final error event and `[DONE]`), waits
at most `LIMIT_GRACE_S` for those answers to go out, and only then lets uvicorn shut down: uvicorn's
own graceful-shutdown timeout (which cancels the request tasks: a 500 in plain text, streams never
closed, sequences decoding on for nobody) is never what ends a request."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import threading
from collections.abc import Callable
from typing import Any, Protocol

from edge.errors import EX_SOFTWARE
from edge.lifecycle.systemd import Notifier
from edge.serve.connections import ConnectionGuard

__all__ = ["ACCEPT_GRACE_MAX_S", "ACCEPT_GRACE_MIN_S", "DRAIN_IDLE_S", "LIMIT_GRACE_S", "Drain", "close_when_draining",
           "leave"]

log = logging.getLogger("edge")

# After SIGTERM: how long accepted connections get to have their request read (at least, at most),
# and how long an idle keep-alive connection gets to carry one more request.
ACCEPT_GRACE_MIN_S = 0.1
ACCEPT_GRACE_MAX_S = 5.0
DRAIN_IDLE_S = 1.0
# After the drain's limit: the requests edge ended are answered once their models have ended them
# (after the step in progress: a decode cannot be cut short; waited for at most LIMIT_STEP_MAX_S),
# and get LIMIT_GRACE_S from then for their answers' few bytes before a connection still in a
# request is closed (a client that does not read). The process exits within drain_timeout_s + 2 s
# where a step is well under a second: the step, this, uvicorn's shutdown (~0.2 s), closing the models.
LIMIT_GRACE_S = 1.0
LIMIT_STEP_MAX_S = 30.0


class Dispatcher(Protocol):
    """What the drain needs of the dispatcher (edge.lifecycle.serving): whether it is stopping."""

    stopping: bool


class Drain:
    """SIGTERM/SIGINT while serving: stop accepting (what waits in the backlog stays there for
    the next process), then let every connection finish without a client seeing a reset:

    - a connection with a request in progress finishes it; its response says `Connection: close`;
    - an accepted connection with no request yet gets its request read and answered;
    - an idle keep-alive connection may still carry the request its client is sending right
      now: it gets `DRAIN_IDLE_S` to do so (answered with `Connection: close`), and is closed
      after that only while no byte of a request has arrived on it.

    uvicorn's own shutdown would close connections that have no request in progress at once
    (resetting requests already on their way), and asyncio's Server.close() drops connections
    whose accept() ran but whose transport is not made yet; so the drain waits until no
    connection is left (or drain_timeout_s), and only then lets uvicorn shut down."""

    def __init__(self, dispatcher: Dispatcher, notifier: Notifier, loop: asyncio.AbstractEventLoop,
                 guard: ConnectionGuard, timeout_s: float) -> None:
        self.dispatcher, self.notifier, self.loop, self.guard = dispatcher, notifier, loop, guard
        self.timeout_s = timeout_s
        self.stopped_at = 0.0
        # called once when the drain has no connection left, before uvicorn's shutdown (a handover:
        # the new process's models may decode from then on, edge.lifecycle.handover.successor)
        self.on_empty: Callable[[], None] | None = None
        # called once at the limit with requests still in progress: ends them all (the
        # dispatcher's end_work); how many requests were still running, and an event per worker
        # set once it has ended them
        self.on_limit: Callable[[], tuple[int, list[threading.Event]]] | None = None
        self.limit_at: float | None = None  # loop time the limit was reached with requests left
        self._ending: list[threading.Event] = []
        self._ended_at: float | None = None  # loop time every worker had ended what it ran
        self.ended_at_limit = 0  # requests still in progress then (what the limit ended)
        self.cut = 0  # connections still in a request LIMIT_GRACE_S later, closed

    def on_signal(self, server: Any) -> None:
        if server.should_exit or self.dispatcher.stopping:
            server.force_exit = True  # a second signal: stop waiting for in-flight requests
            server.should_exit = True
            self._limit(server.server_state.connections, self.loop.time())  # and end them now
            return
        self.begin(server)

    def begin(self, server: Any, status: str = "draining in-flight requests", stopping: bool = True) -> None:
        """Stop accepting and drain, STOPPING=1 with `status` (a signal's, or a fatal error's);
        not `stopping`: a handover (edge.lifecycle.handover.handover), where the service goes on in
        another process and systemd must not hear of a stop."""
        if self.dispatcher.stopping:
            return
        self.dispatcher.stopping = True
        if stopping:
            self.notifier.stopping(status)
        else:
            log.info("%s", status)
        self.loop.call_soon_threadsafe(self._stop_accepting, server)

    def _stop_accepting(self, server: Any) -> None:
        self.guard.close_gates()
        for srv in getattr(server, "servers", []):
            for sock in srv.sockets:
                self.loop.remove_reader(sock.fileno())
        self.stopped_at = self.loop.time()
        self.loop.call_later(ACCEPT_GRACE_MIN_S, self._tick, server)

    def _tick(self, server: Any) -> None:
        now = self.loop.time()
        conns = server.server_state.connections
        for conn in list(conns):
            if self._may_close(conn, now):
                conn.transport.close()
        if not conns and self.on_empty is not None:
            self.on_empty, empty = None, self.on_empty
            empty()
        if now - self.stopped_at >= self.timeout_s:
            self._limit(conns, now)
        if not conns or self._past_limit(conns, now):
            server.should_exit = True
        else:
            self.loop.call_later(0.02, self._tick, server)

    def _limit(self, conns: Any, now: float) -> None:
        """The drain's limit (or a second signal): edge ends every request still running, once."""
        if self.limit_at is not None:
            return
        self.limit_at = now
        busy = sum(1 for c in conns if _in_request(c))
        if busy and self.on_limit is not None:
            self.ended_at_limit, self._ending = self.on_limit()
            log.warning("drain: %d requests still running after server.drain_timeout_s = %g s: ended by the "
                        "server (a 503 with Retry-After, or a stream's final error event and [DONE])",
                        self.ended_at_limit, self.timeout_s)

    def _past_limit(self, conns: Any, now: float) -> bool:
        """Past the limit: uvicorn may shut down once no connection is in a request (idle ones it
        closes itself), or LIMIT_GRACE_S after the models ended what they ran, the connections
        still in one closed (a client that does not read its answer)."""
        if self.limit_at is None:
            return False
        if self._ended_at is None and (all(e.is_set() for e in self._ending) or now - self.limit_at >= LIMIT_STEP_MAX_S):
            self._ended_at = now
            if now - self.limit_at > LIMIT_GRACE_S:
                log.warning("drain: the models' step in progress at the limit ended %.1f s after it", now - self.limit_at)
        stuck = [c for c in conns if _in_request(c)]
        if stuck and (self._ended_at is None or now - self._ended_at < LIMIT_GRACE_S):
            return False
        for conn in stuck:
            conn.transport.abort()
        if stuck:
            self.cut = len(stuck)
            log.warning("drain: %d connections still in a request %.1f s after their models ended them (clients "
                        "not reading their answers): closed", len(stuck), LIMIT_GRACE_S)
        return True

    def _may_close(self, conn: Any, now: float) -> bool:
        """An idle connection, quiet for long enough since the drain began, with no request
        bytes arrived (in the kernel or h11's buffer)."""
        cycle = getattr(conn, "cycle", None)
        fresh = cycle is None
        if not fresh and not cycle.response_complete:
            return False  # a request in progress
        quiet = min(self.guard.waited(conn, now), now - self.stopped_at)
        if quiet < (ACCEPT_GRACE_MAX_S if fresh else DRAIN_IDLE_S) or conn.transport.is_closing():
            return False
        return not _request_arriving(conn)


def _in_request(conn: Any) -> bool:
    """A request read (in part) and its response not complete (h11's cycle)."""
    cycle = getattr(conn, "cycle", None)
    return cycle is not None and not cycle.response_complete


def _request_arriving(conn: Any) -> bool:
    buffered = getattr(conn, "conn", None)  # the h11.Connection: part of a request head read
    if buffered is not None and buffered.trailing_data[0]:
        return True
    sock = conn.transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        waiting = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return False
    return waiting > 0


def close_when_draining(app: Any, dispatcher: Dispatcher) -> Any:
    """ASGI: once the drain began, every response tells its client not to reuse the connection."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        async def send_closing(message: Any) -> None:
            if message["type"] == "http.response.start" and dispatcher.stopping:
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, send_closing if scope["type"] == "http" else send)

    return wrapped


def leave(server: Any, reason: str) -> None:
    """A set can serve no more (ServiceState.fatal): one line naming why, then what SIGTERM does
    (stop accepting, STOPPING=1 with the reason, drain); the exit code is 70, which the unit
    restarts, and what waits in the socket's backlog is answered by the next process."""
    log.error("%s: stopping; exiting %d for the unit to restart edge", reason, EX_SOFTWARE)
    server.drain.begin(server, f"failed: {reason}; exiting {EX_SOFTWARE} for a restart")
