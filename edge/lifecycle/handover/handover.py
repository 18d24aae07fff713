"""Process handover: a new `edge serve` takes over from the running one without a gap — what a
reload cannot do in place (a new edge version, a new llama.cpp build, a changed unit environment:
edge.lifecycle.installed; or `edge reload --process`).

    old: RELOADING=1 → config read → memory guard → spawn the new process (the listening sockets
         as fds 3.., LISTEN_FDS, a pipe as EDGE_HANDOVER_FD) → [it starts as any start does:
         load, warm, accept] → "ready" on the pipe → the old stops accepting, MAINPID=<new> and
         READY=1 to systemd, answers `edge reload` → drains (the keep-alive-aware drain) → exits 0
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
import fcntl
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.config import Config, state_dir
from edge.errors import EdgeError
from edge.lifecycle.installed import Running
from edge.lifecycle.loader import read_config
from edge.lifecycle.loadset import split_cores, threads_of
from edge.lifecycle.memguard import handover_decision
from edge.lifecycle.handover.priority import BASE_NICE_ENV, lower_child, successor_yields
from edge.lifecycle.systemd import DRAINED_ENV, HANDOVER_ENV, Notifier
from edge.timing import REPORT_NAME, ReloadTimer, write_report

__all__ = ["HANDOVER_ENV", "Handover"]

log = logging.getLogger("edge")

SPAWN, SUCCESSOR, SWITCH, DRAIN, GUARD, DRAIN_OLD = "spawn", "successor_start", "switch", "drain", \
    "memory_guard", "drain_old"
_PASSED_ON = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM", "INVOCATION_ID", "MANAGERPID")


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
        self.child: _Child | None = None  # the new process, once it took over
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
                child = _spawn(self.held or self.listening(), self.path, self.h.running, self.client_env)
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

    def switch(self, child: "_Child", said: dict[str, Any]) -> dict[str, Any]:
        """Stop accepting (the new process accepts already), hand systemd the main pid, drain."""
        at = self.timer.now()
        self.h.successor_pid = child.pid
        self.child = child  # told when this process has drained (the new one's models wait for it)
        server = self.h.server
        server.drain.on_empty = child.say_drained  # no connection left: the new process decodes
        server.drain.begin(server, f"handed over to pid {child.pid}: draining", stopping=False)
        status = f"{said.get('status', 'ready')} (took over from pid {os.getpid()} in {at:.2f} s)"
        self.h.notifier.send(f"MAINPID={child.pid}\nREADY=1\nSTATUS={status}")
        self.timer.add(SWITCH, at, at, pid=child.pid)
        self.switched_at = at
        self.extra.update(switch_s=round(at, 4), successor=_successor_report(child.pid, state_dir(self.h.current)))
        self._write()
        log.info("handover: pid %d serves; this process (pid %d) drains and exits", child.pid, os.getpid())
        return {"ok": True, "status": status, "exit_code": 0, "report": self.summary()}

    def drained(self) -> None:
        if self.child is not None:
            self.child.say_drained()
        end = self.timer.now()
        self.timer.add(DRAIN, self.switched_at, end)
        self.extra["drain_s"] = round(end - self.switched_at, 4)
        self._write()

    def failed(self, exc: EdgeError, child: "_Child | None" = None) -> dict[str, Any]:
        self.extra["error"] = str(exc)
        if child is not None:
            child.say_drained()
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


class _Child:
    """The new process: its pid, the pipe it says "ready" on, a pidfd that says when it ends."""

    def __init__(self, pid: int, pipe: int, drained: int = -1) -> None:
        self.pid, self.pipe = pid, pipe
        self.drained = drained  # closed once this process has drained: the new one's models may decode
        self.pidfd = os.pidfd_open(pid)
        self.status: int | None = None

    async def ready(self, timeout: float | None) -> dict[str, Any] | None:
        """Its "ready" line; None when it ended first, or did not say it within `timeout`."""
        loop = asyncio.get_running_loop()
        said: asyncio.Future[dict[str, Any] | None] = loop.create_future()
        buf = bytearray()

        def readable() -> None:
            chunk = os.read(self.pipe, 4096)
            buf.extend(chunk)
            if not chunk:  # it is exiting (its files close before it ends): the pidfd says when it has
                loop.remove_reader(self.pipe)
            elif b"\n" in buf and not said.done():
                try:
                    said.set_result(json.loads(bytes(buf).split(b"\n", 1)[0]))
                except ValueError:
                    said.set_result(None)

        loop.add_reader(self.pipe, readable)
        loop.add_reader(self.pidfd, lambda: None if said.done() else said.set_result(None))
        try:
            return await asyncio.wait_for(said, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            loop.remove_reader(self.pipe)
            loop.remove_reader(self.pidfd)

    def failure(self, timeout: float | None) -> str:
        """Why it did not take over; it is killed (if it still runs) and reaped."""
        code = self.reap(kill=True)
        if code is None:
            return f"the new process (pid {self.pid}) did not become ready within {timeout} s: killed"
        how = f"was killed by SIG{signal.Signals(-code).name.removeprefix('SIG')}" if code < 0 \
            else f"exited with status {code}"
        return f"the new process (pid {self.pid}) {how} before it was ready"

    def reap(self, kill: bool) -> int | None:
        """Its exit code (-N: signal N); None when it still ran (then, with `kill`, killed and reaped)."""
        done, status = os.waitpid(self.pid, os.WNOHANG)
        if done == 0:
            if not kill:
                return None
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = -signal.SIGKILL
            self.close()
            return None
        self.status = os.waitstatus_to_exitcode(status)
        self.close()
        return self.status

    def settle(self, folder: Path) -> dict[str, Any]:
        """What its journal says (the phase it was in), into the handover report; the journal
        removed: a handover that failed is the reload's failure, not a crash of the service."""
        from edge.fleet.crashes import crash_report
        from edge.fleet.journal import Stop, read_journal

        found: dict[str, Any] = {"exit": self.status}
        for path in sorted((folder / "journal").glob(f"{self.pid}-*.jsonl")):
            j = read_journal(path)
            if j is None or j.head.get("kind") != "handover":
                continue
            if j.end is None:
                code = self.status or 0
                j.stop = Stop("signal", "killed", signal.Signals(-code).name.removeprefix("SIG")) if code < 0 \
                    else Stop("exit-code", "exited", str(code))
                r = crash_report(j)
                found.update(phase=r["phase"], signal=r["signal"], phases=r["phases"])
            else:
                found.update(phase=j.phase()["enter"], result=j.end.get("end"), error=j.end.get("error"))
            path.unlink(missing_ok=True)
        return found

    def close(self) -> None:
        for fd in (fd for fd in (self.pipe, self.pidfd) if fd >= 0):
            os.close(fd)
        self.pipe = self.pidfd = -1

    def say_drained(self) -> None:
        if self.drained >= 0:
            os.close(self.drained)
            self.drained = -1


def _spawn(sockets: list[Any], path: str | None, running: Running, client_env: dict[str, str] | None) -> _Child:
    """`edge serve` as installed now (this interpreter, `-m edge.cli`: the package on disk), with
    the listening sockets as fds 3.. and the pipe's writing end after them."""
    env = running.successor_environment(client_env)
    n = len(sockets)
    env.update({k: os.environ[k] for k in _PASSED_ON if k in os.environ}, LISTEN_FDS=str(n),
               **{HANDOVER_ENV: f"{3 + n}", DRAINED_ENV: f"{4 + n}",
                  BASE_NICE_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))})
    read_end, write_end = os.pipe()
    drained_read, drained_write = os.pipe()  # this process keeps the writing end until it has drained
    # above every target fd, so that no dup2 below overwrites a source
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in [s.fileno() for s in sockets] + [write_end, drained_read]]
    os.close(write_end)
    os.close(drained_read)
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high)]
    # LISTEN_PID (and WATCHDOG_PID) must name the new process: the shell's $$, which exec keeps
    script = 'export LISTEN_PID=$$; if [ -n "$WATCHDOG_USEC" ]; then export WATCHDOG_PID=$$; fi; exec "$@"'
    argv = [sys.executable, "-m", "edge.cli", "serve", *(["--config", path] if path else [])]
    try:
        pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script, "sh", *argv], env, file_actions=actions)
    except OSError:
        os.close(read_end)
        os.close(drained_write)
        raise
    finally:
        for fd in high:
            os.close(fd)
    lower_child(pid)  # its interpreter's start too runs below the serving threads
    log.info("handover: started pid %d: %s", pid, " ".join(argv))
    return _Child(pid, read_end, drained_write)


def _successor_report(pid: int, folder: Path) -> dict[str, Any]:
    """The new process's start report (it wrote it just before it said ready)."""
    try:
        report = json.loads((folder / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return {"pid": pid}
    keys = ("edge_version", "ready_s", "started_unix", "phases") if report.get("pid") == pid else ()
    return {"pid": pid, **{k: report.get(k) for k in keys}}
