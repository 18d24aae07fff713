"""Process handover: a new `edge serve` takes over from the running one without a gap — what a
reload cannot do in place (a new edge version, a new llama.cpp build, a changed unit environment:
edge.lifecycle.installed; or `edge reload --process`).

    old: RELOADING=1 → config read → memory guard → spawn the new process (the listening sockets
         as fds 3.., LISTEN_FDS, a pipe as EDGE_HANDOVER_FD) → [it starts as any start does:
         load, warm, accept] → "ready" on the pipe → the old stops accepting, passes its queued
         requests on with their connections (edge.lifecycle.handover.pass_on), MAINPID=<new> and
         READY=1 to systemd, answers `edge reload` → drains (the keep-alive-aware drain; at its
         limit what still runs is ended by edge, edge.lifecycle.drain) → exits 0
    new: a start whose READY=1 goes down the pipe (systemd hears it from the old, with MAINPID=);
         from then on it is the service's main process

The new process is the old one's child and inherits the sockets across exec, as nginx's binary
upgrade does: no SCM_RIGHTS exchange and no fd store is needed, because a child that is started
by the old process has them already, and under socket activation systemd holds them anyway. Being
the old one's child also puts it in the unit's cgroup, where systemd accepts `MAINPID=` for it
(the unit has NotifyAccess=all: the new process's watchdog pings count before it is main).

A new process that fails or is not ready in time is killed and the old one serves on; where memory
does not allow both, the handover is today's restart (docs/reload.md, "Handover").
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from edge.config import Config, state_dir
from edge.errors import EdgeError
from edge.lifecycle.installed import Running
from edge.lifecycle.loader import read_config
from edge.lifecycle.loadset import split_cores, threads_of
from edge.lifecycle.memguard import handover_decision
from edge.lifecycle.handover.child import Child, spawn, successor_report
from edge.lifecycle.handover.priority import successor_yields
from edge.lifecycle.systemd import HANDOVER_ENV, Notifier
from edge.timing import ReloadTimer, write_report

__all__ = ["HANDOVER_ENV", "Handover"]

log = logging.getLogger("edge")

SPAWN, SUCCESSOR, SWITCH, DRAIN, GUARD, DRAIN_OLD = "spawn", "successor_start", "switch", "drain", \
    "memory_guard", "drain_old"


# -- the old process's side ---------------------------------------------------------------------
class Handover:
    """The handovers of one serving process (at most one succeeds: then this process drains and
    exits). `server` is the uvicorn server (its drain), `sockets` the listening sockets."""

    def __init__(self, server: Any, sockets: list[socket.socket], notifier: Notifier, running: Running,
                 current: Config, serving: Callable[[], list[Any]] = list) -> None:
        self.server, self.sockets, self.notifier, self.running = server, sockets, notifier, running
        self.current = current
        self.serving = serving  # the serving set's workers: on fewer cores while the new process warms up
        self.successor_pid: int | None = None  # set at the switch: this process drains and exits
        self.restart: asyncio.Future[dict[str, Any]] | None = None  # memory fallback: after the drain
        self.starting: int | None = None  # the pid of a new process not ready yet
        self.abandoned = False  # this process stops: a handover under way ends quietly
        self._run: _HandoverRun | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def reasons(self, client_env: dict[str, str] | None) -> list[str]:
        return self.running.differences(client_env)

    async def run(self, path: str | None, timeout: float | None, client_env: dict[str, str] | None,
                  why: list[str]) -> dict[str, Any]:
        """A handover (or, memory short, a restart); the answer for `edge reload`."""
        run = self._run = _HandoverRun(self, path, why, client_env)
        run.timeout = timeout
        try:
            cfg = await asyncio.to_thread(read_config, path, run.timer)
        except EdgeError as exc:
            return run.failed(exc)
        run.decide(cfg)
        if run.extra["mode"] == "restart":
            log.warning("handover: %s: restarting instead (the old process drains and frees its models "
                        "first; clients wait in the socket's backlog)", run.extra["memory"]["reason"])
            self.restart = asyncio.get_running_loop().create_future()
            run.held = [socket.socket(s.family, s.type, s.proto, fileno=os.dup(s.fileno()))  # uvicorn closes its
                        for s in run.listening()]  # own at the end of the drain
            self.server.drain.begin(self.server, "restarting: draining", stopping=False)
            return await self.restart
        return await run.spawn_and_switch(timeout)

    async def after_drain(self, loaded: Any) -> None:
        """The memory fallback, once this process has drained: free the models, start the new
        process on the held sockets, hand over (or, when it fails, exit 70 for a restart)."""
        run, future = self._run, self.restart
        if run is None or future is None:
            return
        with run.timer.phase(DRAIN_OLD) as ph:
            ph.detail["freed"] = await asyncio.to_thread(loaded.close)
        answer = await run.spawn_and_switch(run.timeout)
        for sock in run.held:
            sock.close()
        if not future.done():
            future.set_result(answer)

    def background(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abandon(self) -> None:
        """This process stops before a new one took over (SIGTERM, systemctl stop): that one is
        killed (its journal settled into the handover report); the handover fails quietly."""
        if self.starting is not None and self.successor_pid is None:
            self.abandoned = True
            log.warning("stopping during a handover: killing the new process (pid %d)", self.starting)
            try:
                os.kill(self.starting, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finished(self) -> None:
        """This process drained after the switch: the report's drain."""
        if self._run is not None and self.successor_pid is not None:
            self._run.drained()


class _HandoverRun:
    """One handover: its timer, its report, the new process."""

    def __init__(self, h: Handover, path: str | None, why: list[str], client_env: dict[str, str] | None) -> None:
        self.h, self.path, self.client_env = h, path, client_env
        self.timer = ReloadTimer()
        self.extra: dict[str, Any] = {"reload_kind": "process", "why": why, "config": path, "mode": None,
                                      "memory": None, "successor": None, "switch_s": None, "drain_s": None}
        self.switched_at = 0.0
        self.child: Child | None = None  # the new process, once it took over
        self.timeout: float | None = None  # for the new process to be ready (edge reload --timeout)
        self.held: list[socket.socket] = []  # the memory fallback: the sockets, kept across the drain
        h.notifier.reloading(f"handing over to a new process: {'; '.join(why)}")

    def listening(self) -> list[Any]:
        """The sockets uvicorn accepts on (the connection guard took the originals over)."""
        return getattr(self.h.server.guard, "sockets", None) or self.h.sockets

    def decide(self, cfg: Config) -> None:
        with self.timer.phase(GUARD) as ph:
            self.extra["config"] = cfg.source
            self.extra["memory"] = handover_decision(cfg)
            self.extra["mode"] = self.extra["memory"]["mode"]
            ph.detail.update(mode=self.extra["mode"], reason=self.extra["memory"]["reason"])

    async def spawn_and_switch(self, timeout: float | None) -> dict[str, Any]:
        with self.timer.phase(SPAWN):
            try:
                child = spawn(self.held or self.listening(), self.path, self.h.running, self.client_env)
            except OSError as exc:
                return self.failed(EdgeError(f"cannot start the new process: {exc}"))
        self.extra["successor"] = {"pid": child.pid}
        self.h.starting = child.pid
        # the fallback freed its set; a new process that yields the CPU (edge.lifecycle.handover.priority)
        # leaves the serving threads as they are
        serving = [] if self.extra["mode"] == "restart" or successor_yields() else self.h.serving()
        # queued behind the requests on each worker's thread (FIFO), not waited for: the switch must
        # not wait for the queue; all cores back (for the drain, or serving on) after the split
        self.h.background(threads_of(serving, split_cores()[1]))
        try:
            with self.timer.phase(SUCCESSOR, pid=child.pid) as ph:
                said = await child.ready(timeout)
                ph.detail["ready"] = said is not None
        finally:
            self.h.starting = None
            self.h.background(threads_of(serving, None))
        if said is None:
            return self.failed(EdgeError(child.failure(timeout)), child)
        child.close()
        return self.switch(child, said)

    def switch(self, child: Child, said: dict[str, Any]) -> dict[str, Any]:
        """Stop accepting (the new process accepts already), hand systemd the main pid, drain."""
        at = self.timer.now()
        self.h.successor_pid = child.pid
        self.child = child  # told when this process has drained (the new one's models wait for it)
        server = self.h.server
        server.drain.on_empty = child.say_drained  # no connection left: the new process decodes
        server.drain.begin(server, f"handed over to pid {child.pid}: draining", stopping=False)
        self.pass_on(child)
        status = f"{said.get('status', 'ready')} (took over from pid {os.getpid()} in {at:.2f} s)"
        self.h.notifier.send(f"MAINPID={child.pid}\nREADY=1\nSTATUS={status}")
        self.timer.add(SWITCH, at, at, pid=child.pid)
        self.switched_at = at
        self.extra.update(switch_s=round(at, 4), successor=successor_report(child.pid, state_dir(self.h.current)))
        self._write()
        log.info("handover: pid %d serves; this process (pid %d) drains and exits", child.pid, os.getpid())
        return {"ok": True, "status": status, "exit_code": 0, "report": self.summary()}

    def pass_on(self, child: Child) -> None:
        """Queued requests (and those that queue from now on) go to the new process with their
        connections; with TLS they cannot (a session's keys stay here), and wait here."""
        server = self.h.server
        if server.config.is_ssl or child.channel is None:
            log.info("handover: queued requests are served here (TLS connections cannot be passed on)")
            return
        from edge.serve.worker import PassedOn

        server.pass_on.to(child.channel)
        for worker in self.h.serving():
            worker.pass_on(PassedOn(f"passed on to pid {child.pid}"))

    def drained(self) -> None:
        if self.child is not None:
            self.child.say_drained()
            self.child.close_channel()
        end = self.timer.now()
        self.timer.add(DRAIN, self.switched_at, end)
        drain = self.h.server.drain
        self.extra.update(drain_s=round(end - self.switched_at, 4), passed_on=self.h.server.pass_on.passed,
                          ended_at_limit=drain.ended_at_limit)
        self._write()

    def failed(self, exc: EdgeError, child: "Child | None" = None) -> dict[str, Any]:
        self.extra["error"] = str(exc)
        if child is not None:
            child.say_drained()
            child.close_channel()
            self.extra["successor"] = {"pid": child.pid, **child.settle(state_dir(self.h.current))}
        log.error("handover failed: %s", exc)
        self._write()
        if self.extra["mode"] == "restart":  # nothing serves here any more: the unit restarts edge
            self.h.notifier.status(f"restart failed: {exc}; exiting 70 for the unit to restart edge")
        elif not (self.h.abandoned or self.h.server.drain.dispatcher.stopping):  # stopping: no READY=1
            self.h.notifier.send(f"READY=1\nSTATUS=handover failed: {exc}; the old process serves on")
        return {"ok": False, "error": str(exc), "exit_code": exc.exit_code, "report": self.summary()}

    def summary(self) -> dict[str, Any]:
        return {k: self.extra.get(k) for k in ("reload_kind", "mode", "why", "config", "memory", "switch_s",
                                               "successor", "error")}

    def _write(self) -> None:
        report = self.timer.report(**self.extra, kind="reload")
        try:
            write_report(report, state_dir(self.h.current), kind="reload")
        except OSError as exc:
            log.warning("cannot write the handover report: %s", exc)
