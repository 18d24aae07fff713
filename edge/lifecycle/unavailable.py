"""While given up (edge.fleet.giveup): a light process that keeps the listening sockets and answers
every request at once, instead of a start loop or a socket left failed.

Why a process that answers, not a stopped socket: a client already waiting in the socket's backlog
is answered at once (a stopped socket resets it, and a socket that systemd stops can end up
`failed`, which only a person's `systemctl` undoes); the socket stays systemd's and active all
along; and `edge status`, `/healthz` and `/metrics` keep saying why. It loads no model and imports
no llama.cpp: config, recovery, sockets, uvicorn, READY=1 in a fraction of a second.

    every route   503, Retry-After: seconds until the retry, `Connection: close`, and a JSON body
                  naming the reason (safe mode exhausted, the last crash's phase and signal)
    /readyz       503 (the same body): not ready
    /healthz      200 {"status": "given_up", ...}: alive, and why it serves nothing
    /metrics      the fleet families (edge_build_info, edge_device_info, edge_given_up,
                  edge_crashes_total{cause}, ...) and edge_ready 0; keyed as the service keys it
                  (API keys configured, metrics_auth = "key"): 401 without one, and where the key
                  file cannot be read now, 401 to every scrape

It ends itself (exit 0, journal `end: given_up`) as soon as the give-up no longer holds:
`edge safe-mode clear` removed the record, the config file, a model file, the llama.cpp build or
the installed edge version changed, or the retry interval passed. Each accept() first checks the
record and the config file (two stat calls), so no connection made after the fix is accepted
here: it waits in the backlog, and socket activation starts the service again for it at once;
the rest (safe mode's keys, the installed version) is checked every `CHECK_S`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import Config, state_dir
from edge.fleet.giveup import GIVE_UP_FILE, GiveUp, fingerprint
from edge.fsutil import file_identity
from edge.lifecycle.server import serve_on, uvicorn_server
from edge.lifecycle.systemd import Notifier, listen_sockets
from edge.timing import Phases, StartTimer

if TYPE_CHECKING:
    from edge.lifecycle.recovery import GivenUp, Recovery

__all__ = ["CHECK_S", "Unavailable", "answer", "answer_given_up", "current_fingerprint", "status_text"]

log = logging.getLogger("edge")

CHECK_S = 2.0  # the full check (keys, installed version): every this many seconds


def _metrics_keys(cfg: Config) -> Any:
    """The keys /metrics needs here, as the service would read them (edge.serve.auth); None when
    it is open. A key file that cannot be read now accepts no key: closed, never open."""
    from edge.errors import ConfigError
    from edge.serve.auth import ApiKeys, key_file, load_api_keys

    if cfg.server.metrics_auth != "key" or key_file(cfg.server, cfg.source) is None:
        return None
    try:
        return load_api_keys(cfg.server, cfg.source)
    except ConfigError:
        return ApiKeys((), "an unreadable key file")


def status_text(give_up: GiveUp) -> str:
    """The READY status line: why, and what ends it."""
    return (f"GIVEN UP: {give_up.reason}; answering 503 until `edge safe-mode clear`, another config, "
            f"model, llama.cpp or edge, or the retry at {give_up.as_dict()['retry_at']}")


def _stamp(path: Path) -> tuple[int, ...] | None:
    try:
        return file_identity(path)
    except OSError:
        return None


def _exit(server: Any) -> None:
    server.should_exit = True


class _Gate(socket.socket):
    """A listening socket that accepts only while the give-up holds; the first accept() that finds
    it over calls `ended()` (which stops reading this socket) and accepts nothing."""

    def __init__(self, sock: socket.socket, holds: Callable[[], bool], ended: Callable[[], None]) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.holds, self.ended = holds, ended

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.holds():
            self.ended()
            raise BlockingIOError  # asyncio's accept loop returns; the reader was removed
        return super().accept()


class Unavailable:
    """The given-up process: `give_up` says why, `current` gives the fingerprint now."""

    def __init__(self, give_up: GiveUp, cfg: Config, notifier: Notifier,
                 current: Callable[[], dict[str, str]]) -> None:
        self.give_up, self.cfg, self.notifier, self.current = give_up, cfg, notifier, current
        self.folder = state_dir(cfg)
        self.stamps = (_stamp(self.folder / GIVE_UP_FILE), _stamp(Path(cfg.source)))
        self.ended_why: str | None = None
        self.server: Any = None
        self.keys = _metrics_keys(cfg)

    def holds(self) -> bool:
        """The cheap check, at each accept: the record and the config file as they were, the
        retry not due."""
        if self.ended_why is None:
            if (_stamp(self.folder / GIVE_UP_FILE), _stamp(Path(self.cfg.source))) != self.stamps:
                self.ended_why = "the give-up record or the config file changed"
            elif time.time() >= self.give_up.retry_at:
                self.ended_why = f"its retry interval ({self.give_up.retry_s:.0f} s) passed"
        return self.ended_why is None

    def end(self) -> None:
        """Stop accepting at once (what is in the backlog stays for the next start) and exit."""
        if self.server is None or self.server.should_exit:
            return
        log.warning("the give-up no longer holds (%s): exiting for a new start", self.ended_why)
        loop = asyncio.get_running_loop()
        for srv in getattr(self.server, "servers", []):
            for sock in srv.sockets:
                loop.remove_reader(sock.fileno())
        self.server.should_exit = True

    async def serve(self, sockets: list[socket.socket]) -> str:
        """Answer until SIGTERM or the give-up ends; why it ended. A signal only ends the serving:
        no re-raise after uvicorn's shutdown (edge.lifecycle.server)."""
        self.server = uvicorn_server(self.app, _exit, interface="asgi3")
        gated = [_Gate(s, self.holds, self.end) for s in sockets]
        await serve_on(gated, self.server, self.notifier, self._ready, beside=[self._check])
        return self.ended_why or "stopped"

    def _ready(self) -> None:
        self.notifier.send(f"READY=1\nSTATUS={status_text(self.give_up)}\nMAINPID={os.getpid()}")  # logged by answer()

    async def _check(self) -> None:
        """The full check every CHECK_S."""
        while True:
            if self.ended_why is None:
                self.ended_why = self.give_up.ended_by(await asyncio.to_thread(self.current))
            if not self.holds():
                self.end()
            await asyncio.sleep(CHECK_S)

    def body(self) -> dict[str, Any]:
        g = self.give_up
        return {"status": "given_up", "reason": g.reason, "phase": g.phase, "signal": g.signal, "target": g.target,
                "since": g.as_dict()["since"], "retry_at": g.as_dict()["retry_at"],
                "ends_with": "edge safe-mode clear, or another config, model file, llama.cpp or edge version"}

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        retry = str(self.give_up.retry_after_s())
        if path == "/metrics" and self.keys is not None and self.keys.refusal(scope.get("headers", [])):
            status, body, kind = 401, b'{"error": {"code": "invalid_api_key"}}', b"application/json"
        elif path == "/metrics":
            status, body, kind = 200, await asyncio.to_thread(self._metrics), b"text/plain; version=0.0.4"
        elif path == "/healthz":
            status, body, kind = 200, json.dumps(self.body()).encode(), b"application/json"
        else:
            error = {"message": f"edge is not serving: {self.give_up.reason}", "type": "unavailable",
                     "code": "given_up", **self.body()}
            status, body, kind = 503, json.dumps({"error": error}).encode(), b"application/json"
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + ([(b"retry-after", retry.encode())] if status == 503 else [])})
        await send({"type": "http.response.body", "body": body})

    def _metrics(self) -> bytes:
        """The fleet families (identity, history, edge_given_up), and edge_ready 0: a given-up device
        is scraped, ready never, and the fleet's rules tell it from a silent one (EdgeGivenUp)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily

        from edge.fleet.metrics import FleetCollector

        class NotReady:
            def collect(self) -> Any:
                yield GaugeMetricFamily("edge_ready", "1 once warm-up finished and the service accepts "
                                        "requests; 0 here: given up, answering 503 (edge_given_up says why).", value=0)

        registry = CollectorRegistry()
        registry.register(FleetCollector(self.folder, lambda: None))
        registry.register(NotReady())
        return generate_latest(registry)


def current_fingerprint(cfg: Config) -> dict[str, str]:
    """What the give-up is compared with now: the config file, safe mode's keys, the edge version
    installed on disk (an OTA or a package update, not the one running here)."""
    from edge.device.identity import assigned_version
    from edge.lifecycle.safemode import safe_mode_keys

    import edge

    installed = assigned_version(Path(edge.__file__)) or edge.__version__
    return fingerprint(cfg.source, safe_mode_keys(cfg), installed)


def answer(give_up: GiveUp, cfg: Config, sockets: list[socket.socket], notifier: Notifier) -> str:
    """Serve the give-up on `sockets` until it ends or SIGTERM; why it ended."""
    log.error("%s", status_text(give_up))
    unavailable = Unavailable(give_up, cfg, notifier, lambda: current_fingerprint(cfg))
    return asyncio.run(unavailable.serve(sockets))


def answer_given_up(given_up: GivenUp, timer: StartTimer, recovery: Recovery, notifier: Notifier) -> int:
    """A start that found safe mode exhausted: its sockets (systemd's, else bound now), the give-up
    recorded, every request answered until the give-up ends or SIGTERM, the journal's end; 0, so
    that the next connection (or one waiting in the backlog) starts the service again."""
    from edge.lifecycle.sockets import bind_sockets

    cfg = given_up.config
    with timer.phase(Phases.SOCKETS):
        sockets = listen_sockets() or bind_sockets(cfg.server, cfg.source)
    recovery.given_up(given_up.give_up, cfg)
    why = answer(given_up.give_up, cfg, sockets, notifier)
    recovery.journal.end("given_up", 0, why=why)
    return 0
