"""The control socket between `edge reload` (and ExecReload=, and the OTA activator) and the
running service: a Unix socket in the service's state directory that only its user (and root)
can connect to; one JSON request per connection, one JSON answer once the reload is done.

    request: {"op": "reload", "config": str | null, "timeout": number | null,
              "process": bool | null, "env": {str: str} | null}
    answer:  {"ok": bool, "exit_code": int, "status"/"error": str, "report": {...}}

`process`: true forces a handover to a new process, null lets the service choose
(edge.lifecycle.installed); `env` is the environment `edge reload` runs in (the unit's, when
systemd runs it as ExecReload=). The service's side is a `ControlServer` that hands each request
to the reloader (edge.lifecycle.reload);
`request_reload` is the client's side, and needs nothing of the service's modules.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from edge.config import Config, state_dir
from edge.errors import EdgeError, ServiceUnreachable

__all__ = ["CONTROL_NAME", "ControlServer", "control_path", "request_reload"]

CONTROL_NAME = "control.sock"

# (config, timeout, process, env) -> the answer
Handler = Callable[[str | None, float | None, "bool | None", "dict[str, str] | None"], Awaitable[dict[str, Any]]]


def control_path(cfg: Config) -> Path:
    """The control socket of the service that runs with `cfg`: in its state directory."""
    return state_dir(cfg) / CONTROL_NAME


class ControlServer:
    """The service's side: `open()` listens at `path` (OSError when it cannot), each request goes
    to `handler`, `close()` removes the socket again."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path, self.handler = path, handler
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None
        self._answering: set[asyncio.Task[Any]] = set()

    async def open(self) -> None:
        sock = _bind_private(self.path)
        self._inode = self.path.stat().st_ino
        self._server = await asyncio.start_unix_server(self._handle, sock=sock)

    def close(self) -> None:
        """Stop listening; the socket file removed unless it is another process's by now (a
        handover's new process bound its own at the same path)."""
        if self._server is not None:
            self._server.close()
            try:
                if self.path.stat().st_ino == self._inode:
                    self.path.unlink()
            except OSError:
                pass

    async def answered(self, timeout: float = 10.0) -> None:
        """Until every request being handled has had its answer written (at most `timeout`)."""
        if self._answering:
            await asyncio.wait(set(self._answering), timeout=timeout)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)
        try:
            req = json.loads(await asyncio.wait_for(reader.readline(), 10))
            config, timeout, process, env = req.get("config"), req.get("timeout"), req.get("process"), req.get("env")
            if req.get("op") != "reload" or not isinstance(config, (str, type(None))) \
                    or not isinstance(timeout, (int, float, type(None))) or not isinstance(process, (bool, type(None))) \
                    or not (env is None or isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
                raise ValueError("expected {op: reload, config: str|null, timeout: number|null, process: "
                                 f"bool|null, env: {{str: str}}|null}}, found {req}")
            result = await self.handler(config, timeout, process, env)
        except (ValueError, AttributeError, asyncio.TimeoutError) as exc:
            result = {"ok": False, "error": f"bad control request: {exc}", "exit_code": 64}
        try:
            writer.write(json.dumps(result).encode() + b"\n")
            await writer.drain()
            writer.close()
        except OSError:
            pass  # the client went away; the reload's outcome is in its report and STATUS=


def _bind_private(path: Path) -> socket.socket:
    """A listening Unix socket only the service user (and root) can connect to: mode 0600 from
    the moment it exists (fchmod before bind), a stale one from an earlier run replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(8)
    except OSError:
        sock.close()
        raise
    return sock


def request_reload(path: Path, config: str | None, timeout: float | None, process: bool | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """`edge reload`'s side: one request on the control socket, the service's answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(None if timeout is None else timeout + 60)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        raise ServiceUnreachable(f"no edge service answers on {path}: is `edge serve` running with this "
                                 "state directory?") from None
    except PermissionError:
        raise EdgeError(f"{path}: permission denied: run `edge reload` as the service's user or root") from None
    except OSError as exc:
        raise EdgeError(f"cannot reach the service at {path}: {exc}") from None
    with sock:
        sock.sendall(json.dumps({"op": "reload", "config": config, "timeout": timeout, "process": process,
                                 "env": env}).encode() + b"\n")
        raw = b""
        try:
            while not raw.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
        except socket.timeout:
            raise EdgeError(f"no answer from the service within {timeout} s") from None
    if not raw:
        raise EdgeError(f"the service closed {path} without an answer (did it stop?)")
    return json.loads(raw)
