"""A handover passes on what waits: a request still queued in the old process at the switch (none
of its choices started, nothing of its answer sent) is handed to the new process with its client's
connection, and answered there as if the new process had accepted it.

    old: at the switch every model worker passes on its queued requests (edge.serve.worker's
         pass_on: PassedOn; the app answers them with the PASSED_ON head, edge.serve.app), and
         `PassOn`, between the request limits and the dispatcher, takes that head: it stops
         reading the connection, sends a duplicate of its socket (SCM_RIGHTS) with the request's
         bytes (its head as read, its whole body, whatever the client sent after it) down the
         handover's connection channel, and closes its own descriptor without a FIN
    new: `receive_connections` (a thread) takes each one, and `adopt` serves it with uvicorn's
         own protocol, fed the request's bytes first: its drain, limits and keep-alive as for
         any connection it accepted

A TLS connection cannot be passed on (its session keys are in the old process): with TLS, queued
requests stay in the old process's queue. A channel that fails (the new process died) answers the
request 503 with `Retry-After: 0` and `Connection: close`: its client's retry reaches the new one.
What this relies on of uvicorn (`Config.http_protocol_class`, the protocol's constructor,
`server_state`, `lifespan.state`, the h11 cycle's `scope`) is pinned in pyproject.toml and tested
(tests/lifecycle/test_pass_on.py, tests/lifecycle/test_drain_limit.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["PASS_ON_ENV", "PassOn", "adopt", "receive_connections"]

log = logging.getLogger("edge")

PASS_ON_ENV = "EDGE_HANDOVER_CONNECTIONS_FD"  # the new process's end of the connection channel
_HEADER = struct.Struct("!I")  # the length of the request's bytes; the socket rides on it (SCM_RIGHTS)
_DROPPED = (b"content-length", b"transfer-encoding", b"expect")  # the body is whole now; 100-continue was sent
_REFUSED = json.dumps({"error": {"message": "the service handed over to a new process while this request waited "
                                            "in its queue, and could not pass it on: retry it",
                                 "type": "server_error", "param": None, "code": "server_shutting_down"}}).encode()


class PassOn:
    """ASGI, between the request limits and the dispatcher: a request the app answers with the
    PASSED_ON head is handed to the new process (`to()` names the channel; until then, and for a
    connection it cannot find, it is refused 503 with Retry-After: 0). `connections`: uvicorn's
    server_state.connections."""

    def __init__(self, app: Any, connections: Callable[[], set[Any]]) -> None:
        from edge.serve.app import PASSED_ON  # with the HTTP stack, as this layer is

        self.app, self.connections, self.marker = app, connections, PASSED_ON
        self.channel: socket.socket | None = None
        self._lock = threading.Lock()  # one message at a time on the channel
        self.passed = 0  # requests handed to the new process
        self.refused = 0  # requests that could not be: answered 503

    def to(self, channel: socket.socket) -> None:
        self.channel = channel

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body: list[bytes] = []  # as the request limits replay it: one message, the whole body
        marked = False

        async def recording() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def sending(message: dict[str, Any]) -> None:
            nonlocal marked
            if message["type"] == "http.response.start" and self.marker in message.get("headers", ()):
                marked = True
            if not marked:
                await send(message)

        await self.app(scope, recording, sending)
        if marked:
            await self._pass(scope, b"".join(body), send)

    async def _pass(self, scope: dict[str, Any], body: bytes, send: Any) -> None:
        conn = next((c for c in list(self.connections()) if getattr(getattr(c, "cycle", None), "scope", None) is scope),
                    None)
        if self.channel is None or conn is None:
            return await self._refuse(send, "no channel to the new process" if conn else "its connection is gone")
        conn.transport.pause_reading()  # what the client sends from now on is the new process's to read
        trailing = bytes(conn.conn.trailing_data[0])  # read already, not parsed: the request after this one
        raw = request_bytes(scope, body) + trailing
        sock = conn.transport.get_extra_info("socket")
        fd = os.dup(sock.fileno())
        try:
            await asyncio.to_thread(self._send, raw, fd)
        except OSError as exc:
            conn.transport.resume_reading()
            return await self._refuse(send, f"the channel to the new process failed: {exc}")
        finally:
            os.close(fd)
        self.passed += 1
        conn.transport.abort()  # this descriptor only: the socket lives on in the new process, no FIN sent
        for _ in range(10):  # uvicorn sees the connection lost (a callback away), so it answers nothing itself
            if conn.cycle.disconnected:
                break
            await asyncio.sleep(0)

    def _send(self, raw: bytes, fd: int) -> None:
        assert self.channel is not None
        with self._lock:
            socket.send_fds(self.channel, [_HEADER.pack(len(raw))], [fd])
            self.channel.sendall(raw)

    async def _refuse(self, send: Any, why: str) -> None:
        self.refused += 1
        log.warning("handover: a queued request could not be passed on (%s): answered 503, Retry-After: 0", why)
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_REFUSED)).encode()),
                                (b"retry-after", b"0"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": _REFUSED, "more_body": False})


def request_bytes(scope: dict[str, Any], body: bytes) -> bytes:
    """The request as its client sent it, from what uvicorn parsed: its head (names lower-cased, as
    h11 gives them) with the body's length, and the body."""
    target = scope["raw_path"] + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
    head = [b"%s %s HTTP/%s" % (scope["method"].encode(), target, scope["http_version"].encode())]
    head += [b"%s: %s" % (k, v) for k, v in scope["headers"] if k not in _DROPPED]
    head.append(b"content-length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


# -- the new process's side ----------------------------------------------------------------------
async def adopt(server: Any, sock: socket.socket, raw: bytes) -> None:
    """A connection the old process accepted, served by `server` (uvicorn's, started) as one it
    accepted itself: uvicorn's protocol for it, fed `raw` (the request the old one had read)
    before anything the socket brings."""
    listening = getattr(server, "listening", None)  # edge's server: set once it accepts (started)
    if listening is not None:
        await listening.wait()
    config = server.config
    if config.is_ssl:  # the old process never passes one on: a TLS session cannot move
        sock.close()
        return
    loop = asyncio.get_running_loop()

    def protocol() -> asyncio.Protocol:
        proto: Any = config.http_protocol_class(config=config, server_state=server.server_state,
                                                app_state=server.lifespan.state, _loop=loop)
        made = proto.connection_made

        def connection_made(transport: asyncio.Transport) -> None:
            made(transport)
            proto.data_received(raw)  # before the transport's reader is added (asyncio's order)

        proto.connection_made = connection_made
        return proto

    sock.setblocking(False)
    await loop.connect_accepted_socket(protocol, sock)


def receive_connections(channel: socket.socket, loop: asyncio.AbstractEventLoop,
                        serve: Callable[[socket.socket, bytes], Any]) -> threading.Thread:
    """A thread that takes every connection the old process passes on and has `serve(sock, raw)`
    (a coroutine function: `adopt` on this process's server) run on `loop`; it ends when the old
    process closes the channel (it exits)."""

    def run() -> None:
        with channel:
            while (got := _receive(channel)) is not None:
                sock, raw = got
                try:
                    asyncio.run_coroutine_threadsafe(serve(sock, raw), loop)
                except RuntimeError:  # the loop has closed: this process is leaving too
                    sock.close()
                    return

    thread = threading.Thread(target=run, name="edge-passed-on", daemon=True)
    thread.start()
    return thread


def _receive(channel: socket.socket) -> tuple[socket.socket, bytes] | None:
    try:
        head, fds, _, _ = socket.recv_fds(channel, _HEADER.size, 1)
        if not head:
            return None
        sock = socket.socket(fileno=fds[0]) if fds else None
        head += _exactly(channel, _HEADER.size - len(head))
        raw = _exactly(channel, _HEADER.unpack(head)[0])
    except (OSError, ValueError) as exc:
        log.warning("handover: the channel of passed-on connections failed: %s", exc)
        return None
    if sock is None:
        log.warning("handover: a passed-on request came without its connection: dropped")
        return _receive(channel)
    return sock, raw


def _exactly(channel: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = channel.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ValueError(f"the channel closed {n - len(out)} bytes short of a request")
        out += chunk
    return bytes(out)
