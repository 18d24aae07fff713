"""A handover's new process as the old one sees it: spawned as `edge serve` on the inherited
listening sockets (fds 3.., LISTEN_FDS, LISTEN_PID its own) with the pipe it says "ready" on, the
one that tells it the old process has drained and the channel queued requests are passed on by
(edge.lifecycle.handover.pass_on); waited for, reaped, and what its journal and start report say
of it."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from edge.lifecycle.handover.pass_on import PASS_ON_ENV
from edge.lifecycle.handover.priority import BASE_NICE_ENV, lower_child
from edge.lifecycle.installed import Running
from edge.lifecycle.systemd import DRAINED_ENV, HANDOVER_ENV
from edge.timing import REPORT_NAME

__all__ = ["Child", "spawn", "successor_report"]

log = logging.getLogger("edge")

_PASSED_ON = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM", "INVOCATION_ID", "MANAGERPID")


class Child:
    """The new process: its pid, the pipe it says "ready" on, a pidfd that says when it ends, the
    channel this process passes queued requests on by."""

    def __init__(self, pid: int, pipe: int, drained: int = -1, channel: socket.socket | None = None) -> None:
        self.pid, self.pipe = pid, pipe
        self.drained = drained  # closed once this process has drained: the new one's models may decode
        self.channel = channel  # closed once this process has drained: nothing more to pass on
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

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def spawn(sockets: list[Any], path: str | None, running: Running, client_env: dict[str, str] | None) -> Child:
    """`edge serve` as installed now (this interpreter, `-m edge.cli`: the package on disk), with
    the listening sockets as fds 3.., then the pipe's writing end, the drained pipe's reading end
    and its end of the connection channel."""
    env = running.successor_environment(client_env)
    n = len(sockets)
    env.update({k: os.environ[k] for k in _PASSED_ON if k in os.environ}, LISTEN_FDS=str(n),
               **{HANDOVER_ENV: f"{3 + n}", DRAINED_ENV: f"{4 + n}", PASS_ON_ENV: f"{5 + n}",
                  BASE_NICE_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))})
    read_end, write_end = os.pipe()
    drained_read, drained_write = os.pipe()  # this process keeps the writing end until it has drained
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # above every target fd, so that no dup2 below overwrites a source
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
            for fd in [s.fileno() for s in sockets] + [write_end, drained_read, theirs.fileno()]]
    os.close(write_end)
    os.close(drained_read)
    theirs.close()
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
        ours.close()
        raise
    finally:
        for fd in high:
            os.close(fd)
    lower_child(pid)  # its interpreter's start too runs below the serving threads
    log.info("handover: started pid %d: %s", pid, " ".join(argv))
    return Child(pid, read_end, drained_write, ours)


def successor_report(pid: int, folder: Path) -> dict[str, Any]:
    """The new process's start report (it wrote it just before it said ready)."""
    try:
        report = json.loads((folder / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return {"pid": pid}
    keys = ("edge_version", "ready_s", "started_unix", "phases") if report.get("pid") == pid else ()
    return {"pid": pid, **{k: report.get(k) for k in keys}}
