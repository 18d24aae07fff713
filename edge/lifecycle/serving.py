"""Serving a loaded set over HTTP: the `Dispatcher` that routes every request to the set that is
current when it arrives (a reload's switch), the uvicorn server built for it before READY (the
request limits, the API keys, the drain's `Connection: close`; edge.lifecycle.server), and
serving it on the start's sockets until the drain (edge.lifecycle.drain) ends.

Nothing here imports uvicorn at module level: `build_server` imports it in the start's
imports_http phase.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge.config import ServerConfig
from edge.lifecycle.drain import Drain, close_when_draining
from edge.lifecycle.server import serve_on, uvicorn_server
from edge.lifecycle.sockets import listen_backlog
from edge.lifecycle.systemd import Notifier
from edge.serve.auth import AuthMiddleware
from edge.serve.connections import ConnectionGuard
from edge.serve.limits import LimitsMiddleware, RequestLimits, connection_limit

if TYPE_CHECKING:
    from edge.lifecycle.loadset import Loaded
    from edge.serve.tls import TlsFiles

__all__ = ["Dispatcher", "Route", "build_server", "serve_http"]


class Route:
    """One loaded set behind the dispatcher and the requests it is answering right now."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.arrived = asyncio.Event()  # set by every request that comes in

    async def quiet(self, for_s: float, at_most_s: float) -> bool:
        """Wait until no request has been in this set for `for_s` seconds; False if that did not
        happen within `at_most_s` (steady traffic)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + at_most_s
        while (left := end - loop.time()) > 0:
            window = 0.0
            try:
                await asyncio.wait_for(self.idle.wait(), left)
                self.arrived.clear()
                window = min(for_s, max(0.0, end - loop.time()))
                await asyncio.wait_for(self.arrived.wait(), window)
            except asyncio.TimeoutError:
                return self.idle.is_set() and window >= for_s  # a window cut by the deadline: no
        return False

    async def drained(self, timeout: float | None) -> bool:
        """Wait until no request (stream included) is in this set any more; False on timeout."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Dispatcher:
    """The ASGI app uvicorn serves: each request (each one of a keep-alive connection too) goes
    to the set that is current when it arrives and stays there until its response (or stream)
    ends. `switch()` is one reference swap; `hold()` parks new requests while a sequential reload
    has no set to offer, and `switch()` releases them. A set that can serve no more
    (ServiceState.fatal: a lost CUDA context) ends the service: `fatal` says why, `on_fatal`
    (the start's) stops it."""

    def __init__(self, loaded: Loaded) -> None:
        self.route = Route(loaded)
        self._held: asyncio.Event | None = None
        self._stopping = False
        self.fatal: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.exposed: list[str] = []  # sockets others can reach (edge.serve.auth): every reload keeps them keyed
        loaded.state.on_fatal = self._fatal

    def _fatal(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
            if self.on_fatal is not None:
                self.on_fatal(reason)

    @property
    def loaded(self) -> Loaded:
        return self.route.loaded

    @property
    def stopping(self) -> bool:
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        self.route.loaded.state.stopping = value

    def hold(self) -> None:
        self._held = asyncio.Event()

    def switch(self, loaded: Loaded) -> Route:
        """Make `loaded` current (and ready); the previous route, to drain."""
        loaded.state.ready, loaded.state.stopping = True, self._stopping
        loaded.state.on_fatal = self._fatal
        old, self.route = self.route, Route(loaded)
        if self._held is not None:
            self._held.set()
            self._held = None
        return old

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._held is not None:
            if scope.get("path") in ("/healthz", "/readyz"):
                return await _answer_while_held(scope, send)
            await self._held.wait()
        route = self.route
        route.active += 1
        route.idle.clear()
        route.arrived.set()
        try:
            await route.loaded.app(scope, receive, send)
        finally:
            route.active -= 1
            if route.active == 0:
                route.idle.set()


async def _answer_while_held(scope: dict[str, Any], send: Any) -> None:
    # A sequential reload: alive, but not ready (clients wait, health checks must not).
    ready = scope["path"] == "/readyz"
    body = b'{"status": "reloading"}' if ready else b'{"status": "alive"}'
    await send({"type": "http.response.start", "status": 503 if ready else 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_server(dispatcher: Dispatcher, cfg: ServerConfig, notifier: Notifier, tls: TlsFiles | None = None) -> Any:
    """The uvicorn server, loaded (protocol modules imported) before READY, not on first accept;
    the dispatcher wrapped in the request limits and the drain's `Connection: close`; with
    `tls`, uvicorn's own TLS on the same sockets (edge.serve.tls)."""
    metrics = dispatcher.loaded.state.metrics  # carried over by every reload
    guard = ConnectionGuard(cfg, on_shed=metrics.connections_shed, tls=tls is not None)
    drain = Drain(dispatcher, notifier, asyncio.get_running_loop(), guard, cfg.drain_timeout_s)
    # the limits layer's own answers are counted by the current set's metrics middleware
    limited = LimitsMiddleware(dispatcher, RequestLimits.of(cfg), lambda *a: dispatcher.loaded.app.observe(*a))
    # API keys before the limits: a refused request's body is never read (edge.serve.auth)
    keyed = AuthMiddleware(limited, lambda: dispatcher.loaded.state, lambda *a: dispatcher.loaded.app.observe(*a))
    # h11: ConnectionGuard and Drain read its protocol objects. The drain has waited for the
    # in-flight requests already when uvicorn's graceful shutdown begins: 1 s is its last word.
    # A signal goes to the drain, which exits 0 once drained (uvicorn would re-raise it).
    server = uvicorn_server(close_when_draining(keyed, dispatcher), drain.on_signal,
                            timeout_keep_alive=cfg.keepalive_timeout_s,
                            **({"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls else {}))
    server.guard = guard
    server.drain = drain
    server.max_connections = cfg.max_connections
    return server


async def serve_http(server: Any, sockets: list[socket.socket], notifier: Notifier, ready_text: str,
                     stopped: asyncio.Event | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Serve until the drain ends; READY=1 once the sockets are being accepted on, not before
    (edge.lifecycle.server.serve_on), the connection guard's sweeper beside it.
    `stopped`: set by a signal that came before uvicorn took the signals over (drained at once);
    `on_ready`: called once READY=1 is sent."""
    server.config.backlog = max(listen_backlog(s) for s in sockets)
    gated = server.guard.gate(sockets, connection_limit(server.guard.cfg))

    def ready() -> None:
        notifier.ready(ready_text)
        if on_ready is not None:
            on_ready()
        if stopped is not None and stopped.is_set():
            server.handle_exit(signal.SIGTERM, None)

    await serve_on(gated, server, notifier, ready, beside=[lambda: server.guard.run(server.server_state.connections)])
