"""The listening sockets of a start that binds its own (systemd's come through LISTEN_FDS,
edge.lifecycle.systemd): bound from the [server] table before anything slow happens, so a
connection made during the start waits in the kernel's backlog; their names as the report and the
status line say them; and the backlog they have, which uvicorn's listen() keeps."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from pathlib import Path

from edge.config import ServerConfig
from edge.errors import ConfigError, EdgeError

__all__ = ["bind_sockets", "describe_socket", "listen_backlog"]


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
