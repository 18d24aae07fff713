"""HTTP lifecycle: listening sockets, the uvicorn server on sockets bound by someone else,
READY=1 once they are accepted on, the watchdog, the drain after SIGTERM, and the `Dispatcher`
that routes every request to the loaded set that is current when it arrives (a reload's switch).

Nothing here imports uvicorn at module level: `bind_sockets` runs before the HTTP stack is
imported (connections made during the start wait in the kernel's backlog), and `build_server`
imports it in the start's imports_http phase.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import struct
import termios
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import ServerConfig
from edge.errors import ConfigError, EdgeError
from edge.serve.auth import AuthMiddleware
from edge.serve.connections import ConnectionGuard
from edge.serve.limits import LimitsMiddleware, RequestLimits, connection_limit
from edge.lifecycle.systemd import Notifier, watchdog_interval_s

log = logging.getLogger("edge")

if TYPE_CHECKING:
    from edge.lifecycle.loadset import Loaded
    from edge.serve.tls import TlsFiles

__all__ = ["bind_sockets", "describe_socket", "build_server", "listen_backlog", "serve_http", "Dispatcher",
           "Route", "ACCEPT_GRACE_MIN_S", "ACCEPT_GRACE_MAX_S", "DRAIN_IDLE_S"]

# After SIGTERM: how long accepted connections get to have their request read (at least, at most),
# and how long an idle keep-alive connection gets to carry one more request.
ACCEPT_GRACE_MIN_S = 0.1
ACCEPT_GRACE_MAX_S = 5.0
DRAIN_IDLE_S = 1.0


def bind_sockets(cfg: ServerConfig, source: str = "config") -> list[socket.socket]:
    """Listening sockets from the [server] table: a Unix socket if set, else host:port. A bind
    that fails is a ConfigError naming the field (78), but for a port in use: that one may pass
    on a restart (EdgeError, 70)."""
    try:
        return [_bind(cfg)]
    except OSError as exc:
        where = cfg.unix_socket or f"{cfg.host}:{cfg.port}"
        why = f"cannot listen on {where}: {exc.strerror or exc}"
        if cfg.unix_socket:
            raise ConfigError(source, "server.unix_socket", why) from None
        if exc.errno == errno.EADDRINUSE:
            raise EdgeError(f"{why} (server table of {source})") from None
        raise ConfigError(source, "server.port" if exc.errno == errno.EACCES else "server.host", why) from None


def _bind(cfg: ServerConfig) -> socket.socket:
    if cfg.unix_socket:
        path = Path(cfg.unix_socket)
        if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
            path.unlink()  # a stale socket from an earlier run
        elif not path.parent.is_dir():
            raise OSError(errno.ENOENT, f"its folder {path.parent} does not exist")
        elif path.exists() or path.is_symlink():
            raise OSError(errno.EEXIST, f"{'a directory' if path.is_dir() else 'a file that is not a socket'} "
                                        "is in the way")
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

    def on_signal(self, server: Any) -> None:
        if server.should_exit or self.dispatcher.stopping:
            server.force_exit = True  # a second signal: stop waiting for in-flight requests
            server.should_exit = True
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
        if not conns or now - self.stopped_at >= self.timeout_s:
            server.should_exit = True
        else:
            self.loop.call_later(0.02, self._tick, server)

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


def _close_when_draining(app: Any, dispatcher: Dispatcher) -> Any:
    """ASGI: once the drain began, every response tells its client not to reuse the connection."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        async def send_closing(message: Any) -> None:
            if message["type"] == "http.response.start" and dispatcher.stopping:
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, send_closing if scope["type"] == "http" else send)

    return wrapped


def listen_backlog(sock: socket.socket) -> int:
    """The backlog the listening socket has now (as systemd's Backlog= or bind_sockets set it),
    so that uvicorn's listen() keeps it: TCP_INFO's tcpi_sacked is sk_max_ack_backlog on a
    listening socket. Unix sockets do not report it: net.core.somaxconn, the most the kernel
    grants, is never less than what was set."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
            if info[0] == _TCP_LISTEN:
                return struct.unpack_from("I", info, 28)[0]
        except OSError:
            pass
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 4096


_TCP_LISTEN = 10


def build_server(dispatcher: Dispatcher, cfg: ServerConfig, notifier: Notifier, tls: TlsFiles | None = None) -> Any:
    """The uvicorn server, loaded (protocol modules imported) before READY, not on first accept;
    the dispatcher wrapped in the request limits and the drain's `Connection: close`; with
    `tls`, uvicorn's own TLS on the same sockets (edge.serve.tls)."""
    import uvicorn

    metrics = dispatcher.loaded.state.metrics  # carried over by every reload
    guard = ConnectionGuard(cfg, on_shed=metrics.connections_shed, tls=tls is not None)
    drain = Drain(dispatcher, notifier, asyncio.get_running_loop(), guard, cfg.drain_timeout_s)

    class Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would make a
        # clean drain exit as "killed by signal"; edge drains and then exits 0 instead.
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.on_signal(self)

    # the limits layer's own answers are counted by the current set's metrics middleware
    limited = LimitsMiddleware(dispatcher, RequestLimits.of(cfg), lambda *a: dispatcher.loaded.app.observe(*a))
    # API keys before the limits: a refused request's body is never read (edge.serve.auth)
    keyed = AuthMiddleware(limited, lambda: dispatcher.loaded.state, lambda *a: dispatcher.loaded.app.observe(*a))
    wrapped = _close_when_draining(keyed, dispatcher)
    # h11: ConnectionGuard and Drain read its protocol objects. The drain has waited for the
    # in-flight requests already when uvicorn's graceful shutdown begins: 1 s is its last word.
    config = uvicorn.Config(wrapped, loop="asyncio", http="h11", lifespan="off", access_log=False,
                            log_config=None, log_level="warning", timeout_keep_alive=cfg.keepalive_timeout_s,
                            timeout_graceful_shutdown=1, **({"ssl_certfile": str(tls.cert),
                                                             "ssl_keyfile": str(tls.key)} if tls else {}))
    config.load()
    server = Server(config)
    server.guard = guard
    server.drain = drain
    server.max_connections = cfg.max_connections
    return server


async def serve_http(server: Any, sockets: list[socket.socket], notifier: Notifier, ready_text: str,
                     stopped: asyncio.Event | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Serve until the drain ends; READY=1 once the sockets are being accepted on, not before.
    `stopped`: set by a signal that came before uvicorn took the signals over (drained at once);
    `on_ready`: called once READY=1 is sent."""
    server.config.backlog = max(listen_backlog(s) for s in sockets)
    gated = server.guard.gate(sockets, connection_limit(server.guard.cfg))
    serving = asyncio.create_task(server.serve(sockets=gated))
    while not server.started and not serving.done():
        await asyncio.sleep(0.001)
    if server.started:
        notifier.ready(ready_text)
        if on_ready is not None:
            on_ready()
        if stopped is not None and stopped.is_set():
            server.handle_exit(signal.SIGTERM, None)
    watchdog = asyncio.create_task(_watchdog(notifier)) if watchdog_interval_s() else None
    sweeper = asyncio.create_task(server.guard.run(server.server_state.connections))
    try:
        await serving
    finally:
        sweeper.cancel()
        if watchdog:
            watchdog.cancel()


async def _watchdog(notifier: Notifier) -> None:
    # Pinged from the event loop itself: a wedged loop stops the pings and systemd restarts us.
    period = (watchdog_interval_s() or 0) / 4
    while True:
        notifier.watchdog()
        await asyncio.sleep(period)
