"""HTTP lifecycle: listening sockets, the uvicorn server on sockets bound by someone else,
READY=1 once they are accepted on, the watchdog, the drain after SIGTERM, and the `Dispatcher`
that routes every request to the loaded set that is current when it arrives (a reload's switch).

Nothing here imports uvicorn at module level: `bind_sockets` runs before the HTTP stack is
imported (connections made during the start wait in the kernel's backlog), and `build_server`
imports it in the start's imports_http phase.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import ServerConfig
from edge.errors import EdgeError
from edge.systemd import Notifier, watchdog_interval_s

if TYPE_CHECKING:
    from edge.start import Loaded

__all__ = ["bind_sockets", "describe_socket", "build_server", "serve_http", "Dispatcher", "Route",
           "ACCEPT_GRACE_MIN_S", "ACCEPT_GRACE_MAX_S"]

# After SIGTERM: how long accepted connections get to have their request read (at least, at most).
ACCEPT_GRACE_MIN_S = 0.1
ACCEPT_GRACE_MAX_S = 5.0


def bind_sockets(cfg: ServerConfig, source: str = "config") -> list[socket.socket]:
    """Listening sockets from the [server] table: a Unix socket if set, else host:port."""
    try:
        return [_bind(cfg)]
    except OSError as exc:
        where = cfg.unix_socket or f"{cfg.host}:{cfg.port}"
        raise EdgeError(f"cannot listen on {where} (server table of {source}): {exc.strerror}") from None


def _bind(cfg: ServerConfig) -> socket.socket:
    if cfg.unix_socket:
        path = Path(cfg.unix_socket)
        if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
            path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, int(cfg.unix_socket_mode, 8))
    else:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
    sock.listen(cfg.backlog)
    return sock


def describe_socket(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name}"
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


class Route:
    """One loaded set behind the dispatcher and the requests it is answering right now."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

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
    has no set to offer, and `switch()` releases them."""

    def __init__(self, loaded: Loaded) -> None:
        self.route = Route(loaded)
        self._held: asyncio.Event | None = None
        self._stopping = False

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


class Drain:
    """SIGTERM/SIGINT while serving: stop accepting, let every accepted connection have its
    request read, then let uvicorn finish the in-flight requests (drain_timeout_s) and exit 0."""

    def __init__(self, dispatcher: Dispatcher, notifier: Notifier, loop: asyncio.AbstractEventLoop) -> None:
        self.dispatcher, self.notifier, self.loop = dispatcher, notifier, loop

    def on_signal(self, server: Any) -> None:
        if server.should_exit or self.dispatcher.stopping:
            server.force_exit = True  # a second signal: stop waiting for in-flight requests
            server.should_exit = True
            return
        self.dispatcher.stopping = True
        self.notifier.stopping()
        self.loop.call_soon_threadsafe(self._stop_accepting, server)

    def _stop_accepting(self, server: Any) -> None:
        # Stop accepting, then wait until every connection already accepted has had its
        # request read, and only then let uvicorn shut down; what is still in the backlog
        # stays there for the next process. Two races make clients see resets otherwise:
        # uvicorn's shutdown closes connections that have no request yet, and asyncio's
        # Server.close() drops (unclosed, later reset) connections whose accept() ran but
        # whose transport was not made yet. So accepting stops by removing the listening
        # sockets' readers, and the Server is closed later by uvicorn.
        for srv in getattr(server, "servers", []):
            for sock in srv.sockets:
                self.loop.remove_reader(sock.fileno())
        deadline = self.loop.time() + ACCEPT_GRACE_MAX_S
        self.loop.call_later(ACCEPT_GRACE_MIN_S, self._exit_when_no_request_pending, server, deadline)

    def _exit_when_no_request_pending(self, server: Any, deadline: float) -> None:
        waiting = [c for c in server.server_state.connections if getattr(c, "cycle", 1) is None]
        if not waiting or self.loop.time() >= deadline:
            server.should_exit = True
        else:
            self.loop.call_later(0.05, self._exit_when_no_request_pending, server, deadline)


def build_server(dispatcher: Dispatcher, cfg: ServerConfig, notifier: Notifier) -> Any:
    """The uvicorn server, loaded (protocol modules imported) before READY, not on first accept."""
    import uvicorn

    drain = Drain(dispatcher, notifier, asyncio.get_running_loop())

    class Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would make a
        # clean drain exit as "killed by signal"; edge drains and then exits 0 instead.
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.on_signal(self)

    config = uvicorn.Config(dispatcher, loop="asyncio", lifespan="off", access_log=False, log_config=None,
                            log_level="warning", timeout_keep_alive=5,
                            timeout_graceful_shutdown=int(cfg.drain_timeout_s) or None)
    config.load()
    return Server(config)


async def serve_http(server: Any, sockets: list[socket.socket], notifier: Notifier, ready_text: str) -> None:
    """Serve until the drain ends; READY=1 once the sockets are being accepted on, not before."""
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.001)
    if server.started:
        notifier.ready(ready_text)
    watchdog = asyncio.create_task(_watchdog(notifier)) if watchdog_interval_s() else None
    try:
        await serving
    finally:
        if watchdog:
            watchdog.cancel()


async def _watchdog(notifier: Notifier) -> None:
    # Pinged from the event loop itself: a wedged loop stops the pings and systemd restarts us.
    period = (watchdog_interval_s() or 0) / 4
    while True:
        notifier.watchdog()
        await asyncio.sleep(period)
