"""The connection cap and the header timeout, over uvicorn's h11 protocol (`ConnectionGuard`).

- At most `server.max_connections` open connections. At the cap, a new connection is admitted
  by closing (shedding) the connections that have waited longest for a complete request head:
  fresh ones that sent nothing or half a head, and idle keep-alive ones, oldest first; never
  one with a request in progress. Shed connections are counted (`edge_connections_shed_total`)
  and each burst of shedding is logged once. Only when every open connection is in a request
  does a new one wait in the kernel's listen backlog (bounded, served in order as slots free)
  instead of exhausting file descriptors for everyone.
- A request head must be complete within `header_timeout_s` of the connection's opening (on a
  kept-alive connection: of the end of `keepalive_timeout_s` idle time), so idle or slowloris
  connections are closed, never held forever, even without new connections pushing them out.
- With TLS the same holds from the accept on: asyncio makes uvicorn's protocol only once the
  handshake is done (and gives a handshake 60 s), so until then a connection is a socket the
  guard counts from its accept. One that has not finished its handshake is shed like a fresh
  plain one at the cap, and ended when `header_timeout_s` has passed since its accept: the
  handshake's timeout. It is ended by `shutdown()` of its socket, never a close: asyncio still
  owns the descriptor, reads the end of stream and closes the connection itself.

uvicorn's own `limit_concurrency` is not used: it answers 503 (plain text) only once a request
has been read, so idle connections still take a file descriptor each, and it counts idle
connections as load.
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from edge.config import ServerConfig

__all__ = ["AcceptPaused", "ConnectionGuard", "GatedSocket", "SHED_BATCH", "SHED_QUIET_S"]

log = logging.getLogger("edge")

SHED_BATCH = 64  # most connections shed at once: each holds its descriptor until the loop's next turn
SHED_QUIET_S = 5.0  # shedding after this long without any is a new burst (logged again)


class AcceptPaused(OSError):
    """Raised by `GatedSocket.accept()` at the connection limit with nothing to shed. asyncio
    handles it as it handles EMFILE: it stops reading the listening socket and tries again a
    second later, while the connections wait in the kernel's backlog. Nothing is logged for it
    (`ConnectionGuard`)."""

    def __init__(self) -> None:
        super().__init__(errno.EMFILE, "edge: connection limit reached")


class GatedSocket(socket.socket):
    """A listening socket that accepts only while fewer than `limit` accepted connections are
    open (counted by their socket objects, which the transports close) and while `open`; at
    the limit it asks the guard to shed connections that wait for a request head."""

    def __init__(self, sock: socket.socket, limit: int, guard: ConnectionGuard) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.limit = limit
        self.guard = guard
        self.open = True  # False: the drain stopped accepting for good
        self.accepted: list[socket.socket] = []
        self.saturated = False
        self._paused = False

    def live(self) -> int:
        self.accepted = [s for s in self.accepted if s.fileno() != -1]
        return len(self.accepted)

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.open:
            raise AcceptPaused()
        if self._paused:  # asyncio goes on calling in the turn it paused in: end that turn
            self._paused = False
            raise BlockingIOError
        if len(self.accepted) >= self.limit and not self._room():
            if not self.saturated:
                log.warning("connection limit reached: %d open (server.max_connections), all in a "
                            "request; new connections wait in the listen backlog", self.limit)
            self.saturated = self._paused = True
            raise AcceptPaused()
        self.saturated = False
        conn, addr = super().accept()
        self.accepted.append(conn)
        self.guard.accepted(conn)
        return conn, addr

    def _room(self) -> bool:
        live = self.live()
        if live < self.limit:
            return True
        closing = self.guard.closing()
        if live - closing < self.limit:
            return True  # connections shed already: their descriptors close on the loop's next turn
        if closing >= SHED_BATCH:
            raise BlockingIOError  # asyncio accepts again on its next turn, once those are closed
        if self.guard.shed(min(self._queued(), SHED_BATCH - closing)) > 0:
            return True
        if self.guard.unseen() > 0:
            raise BlockingIOError  # accepted, protocols not made yet: candidates on the next turn
        return False

    def _queued(self) -> int:
        """Connections waiting in the accept queue (TCP_INFO's tcpi_unacked on a listening
        socket); at least 1: the one being accepted."""
        if self.family in (socket.AF_INET, socket.AF_INET6):
            try:
                info = self.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                return max(1, struct.unpack_from("I", info, 24)[0])
            except OSError:
                pass
        return 1


def _fd(conn: Any) -> int:
    sock = conn.transport.get_extra_info("socket")
    return -1 if sock is None else sock.fileno()


def _end_handshake(sock: socket.socket) -> None:
    """End a connection whose protocol asyncio has not made yet (its TLS handshake runs): the
    transport reads the end of stream and closes the socket it owns (a close here would free a
    descriptor asyncio still watches)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # the peer is gone already: asyncio sees that too


def _quiet_accept_pauses(loop: asyncio.AbstractEventLoop) -> None:
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), AcceptPaused):
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)


class ConnectionGuard:
    """The connection limit, shedding and the header timeout for one uvicorn server.

    Reads uvicorn's h11 protocol objects (`cycle`, `transport`; pinned by tests/serve/test_limits.py):
    a connection is "waiting for a head" while it has no request cycle, or its last response
    is complete. A fresh connection waits from its accept(); a phase after that (keep-alive
    idle time) from when a sweep first sees it. Swept every `tick` seconds, so a timeout fires
    up to one tick late. `on_shed(n)` counts the connections shed."""

    def __init__(self, cfg: ServerConfig, on_shed: Callable[[int], None] | None = None, tls: bool = False) -> None:
        self.cfg = cfg
        self.on_shed = on_shed
        self.tls = tls  # the sockets serve TLS: a connection has no protocol until its handshake is done
        self.tick = min(max(min(cfg.header_timeout_s, cfg.keepalive_timeout_s) / 4, 0.05), 1.0)
        self._since: dict[Any, tuple[Any, float]] = {}  # connection -> (phase key, its start)
        # descriptor -> (its socket, when accepted), until its protocol is seen (after a TLS handshake)
        self._accepted_at: dict[int, tuple[socket.socket, float]] = {}
        self._shed: set[Any] = set()  # shed connections not closed yet
        self._shed_sockets: list[socket.socket] = []  # shed in their handshake, not closed yet
        self._last_shed = float("-inf")
        self.sockets: list[GatedSocket] = []
        self.connections: set[Any] = set()  # uvicorn's server_state.connections, from run()

    def gate(self, sockets: list[socket.socket], limit: int) -> list[socket.socket]:
        _quiet_accept_pauses(asyncio.get_running_loop())
        self.sockets = [GatedSocket(s, limit, self) for s in sockets]
        return list(self.sockets)

    def close_gates(self) -> None:
        for s in self.sockets:
            s.open = False

    def head_limit(self, conn: Any) -> float | None:
        """How long this connection may wait for a complete request head, or None (in a request)."""
        cycle = getattr(conn, "cycle", None)
        if cycle is None:
            return self.cfg.header_timeout_s
        if cycle.response_complete:
            return self.cfg.keepalive_timeout_s + self.cfg.header_timeout_s
        return None

    def accepted(self, conn: socket.socket) -> None:
        self._accepted_at[conn.fileno()] = (conn, asyncio.get_running_loop().time())

    def handshaking(self) -> list[tuple[float, socket.socket]]:
        """(accepted at, socket) of the accepted connections that have no protocol yet: a TLS
        handshake not finished. Without TLS there is none: a plain connection has its protocol
        on the loop's next turn (`GatedSocket._room` waits for it)."""
        if not self.tls:
            return []
        known = {_fd(c) for c in self.connections}
        out = []
        for fd, (sock, at) in list(self._accepted_at.items()):
            if sock.fileno() != fd:  # closed (its descriptor may be another connection's by now)
                del self._accepted_at[fd]
            elif fd not in known:
                out.append((at, sock))
        return out

    def waited(self, conn: Any, now: float) -> float:
        """Seconds this connection has been in its present phase: since it was accepted, or
        since it was first seen in a later phase (a request, keep-alive idle time)."""
        key = (id(getattr(conn, "cycle", None)), self.head_limit(conn) is None)
        seen = self._since.get(conn)
        if seen is None or seen[0] != key:
            start = self._accepted_at.pop(_fd(conn), (None, now))[1] if seen is None else now
            self._since[conn] = (key, start)
            return now - start
        return now - seen[1]

    def unseen(self) -> int:
        """Accepted connections whose protocol uvicorn has not made yet (on the loop's next turn)."""
        return sum(s.live() for s in self.sockets) - len(self.connections)

    def closing(self) -> int:
        """Shed connections whose descriptors are still open (uvicorn drops a connection from
        its set when its transport has closed the socket; asyncio closes the socket of one shed
        in its handshake)."""
        self._shed &= self.connections
        self._shed_sockets = [s for s in self._shed_sockets if s.fileno() != -1]
        return len(self._shed) + len(self._shed_sockets)

    def shed(self, n: int) -> int:
        """Close up to `n` of the connections that have waited longest for a request head (idle
        keep-alive ones, and those still in their TLS handshake, included); how many were closed."""
        now = asyncio.get_running_loop().time()
        waiting: list[tuple[float, Any]] = [(self.waited(c, now), c) for c in self.connections
                                            if self.head_limit(c) is not None and not c.transport.is_closing()]
        waiting += [(now - at, sock) for at, sock in self.handshaking() if sock not in self._shed_sockets]
        victims = [c for _, c in heapq.nlargest(n, waiting, key=lambda w: w[0])]
        if victims and now - self._last_shed > SHED_QUIET_S:
            log.warning("connection limit reached: %d open (server.max_connections); closing the "
                        "connections that waited longest for a request head (idle keep-alive ones "
                        "too) to admit new ones (counted in edge_connections_shed_total)",
                        len(self.connections))
        for conn in victims:
            if isinstance(conn, socket.socket):
                _end_handshake(conn)
                self._shed_sockets.append(conn)
            else:
                conn.transport.abort()  # no lingering close: its descriptor is free on the next turn
                self._shed.add(conn)
        if victims:
            self._last_shed = now
            if self.on_shed is not None:
                self.on_shed(len(victims))
        return len(victims)

    def sweep(self, connections: set[Any], now: float) -> None:
        for conn in list(self._since):
            if conn not in connections:
                del self._since[conn]
        for at, sock in self.handshaking():  # the handshake's timeout: header_timeout_s from the accept
            if now - at >= self.cfg.header_timeout_s and sock not in self._shed_sockets:
                log.debug("closing a connection whose TLS handshake did not finish in %.1f s", now - at)
                _end_handshake(sock)
                self._shed_sockets.append(sock)
        for conn in list(connections):
            limit = self.head_limit(conn)
            waited = self.waited(conn, now)
            if limit is not None and waited >= limit and not conn.transport.is_closing():
                log.debug("closing a connection with no complete request head after %.1f s", waited)
                conn.transport.close()

    async def run(self, connections: set[Any]) -> None:
        self.connections = connections
        loop = asyncio.get_running_loop()
        while True:
            self.sweep(connections, loop.time())
            await asyncio.sleep(self.tick)
