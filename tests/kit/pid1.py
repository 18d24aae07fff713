"""A stand-in for PID 1, for tests and benchmarks: what systemd does for a socket-activated
Type=notify service, done in-process.

It binds the listening socket once and keeps it for its whole life, starts the service with the
socket as fd 3 and LISTEN_FDS/LISTEN_PID set (LISTEN_PID is the child's own pid: a shell sets it
to $$ and then execs the service), and receives sd_notify datagrams on its own NOTIFY_SOCKET with
the sender's pid (SCM_CREDENTIALS). Stopping and starting the service again on the same socket
is exactly a systemd restart: connections made meanwhile wait in the socket's backlog.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Child", "Notification", "PidOne"]


@dataclass
class Notification:
    at: float  # time.monotonic() on receipt
    pid: int
    fields: dict[str, str] = field(default_factory=dict)


class PidOne:
    def __init__(self, argv: list[str], *, host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 1024, env: dict[str, str] | None = None,
                 watchdog_usec: int | None = None, log_path: Path | None = None) -> None:
        self.argv = argv
        self.env = dict(os.environ if env is None else env)
        self.watchdog_usec = watchdog_usec
        self._dir = tempfile.TemporaryDirectory(prefix="edge-pid1-")
        self.log_path = log_path or Path(self._dir.name) / "service.log"
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(backlog)
        self.address = self.listener.getsockname()[:2]
        self.notify_path = str(Path(self._dir.name) / "notify")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._notify.bind(self.notify_path)
        self.notifications: list[Notification] = []
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._receive, name="pid1-notify", daemon=True).start()
        self.proc: Child | None = None

    # -- sd_notify receiver ------------------------------------------------------------------
    def _receive(self) -> None:
        creds_size = struct.calcsize("3i")
        while not self._closed:
            try:
                data, anc, _, _ = self._notify.recvmsg(4096, socket.CMSG_SPACE(creds_size))
            except OSError:
                return
            pid = 0
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:creds_size])[0]
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.notifications.append(Notification(time.monotonic(), pid, fields))
                self._cond.notify_all()

    def wait_for(self, key: str, value: str | None = None, *, pid: int | None = None,
                 timeout: float = 120.0) -> Notification:
        """The first notification (from `pid`, default the current child) that sets key[=value]."""
        pid = pid if pid is not None else (self.proc.pid if self.proc else None)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for n in self.notifications:
                    if key in n.fields and (value is None or n.fields[key] == value) \
                            and (pid is None or n.pid == pid):
                        return n
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"service exited with {self.proc.returncode} before {key}: "
                                       f"{self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {key} from the service in {timeout} s: {self.log_tail()}")
                self._cond.wait(min(left, 0.2))

    def wait_count(self, key: str, count: int, *, after: float = 0.0, timeout: float = 60.0) -> list[Notification]:
        """The first `count` notifications from the current child setting `key`, received after
        `after` (time.monotonic()); waits until there are that many."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                pid = self.proc.pid if self.proc else None
                got = [n for n in self.notifications if key in n.fields and n.at >= after and n.pid == pid]
                if len(got) >= count:
                    return got[:count]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc is not None and self.proc.poll() is not None):
                    raise TimeoutError(f"{len(got)} of {count} {key} notifications: {self.log_tail()}")
                self._cond.wait(min(left, 0.2))

    # -- the service's life ------------------------------------------------------------------
    def start(self) -> "Child":
        env = {**self.env, "LISTEN_FDS": "1", "NOTIFY_SOCKET": self.notify_path}
        env.pop("LISTEN_PID", None)
        env.pop("WATCHDOG_PID", None)
        if self.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.watchdog_usec)
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        # The shell's $$ is the pid that exec keeps: that is what LISTEN_PID must name.
        script = ('export LISTEN_PID=$$; if [ -n "$WATCHDOG_USEC" ]; then export WATCHDOG_PID=$$; fi; '
                  'exec "$@"')
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2),
                   (os.POSIX_SPAWN_DUP2, self.listener.fileno(), 3)]  # dup2 clears close-on-exec
        try:
            pid = os.posix_spawn("/bin/sh", ["sh", "-c", script, "sh", *self.argv], env,
                                 file_actions=actions)
        finally:
            os.close(log)
        self.proc = Child(pid)
        return self.proc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the service and reap it; SIGKILL after `timeout`. Returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except TimeoutError:
            self.proc.send_signal(signal.SIGKILL)
            return self.proc.wait(10)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL, timeout=10)
        self._closed = True
        self._notify.close()
        self.listener.close()
        self._dir.cleanup()

    def __enter__(self) -> "PidOne":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Child:
    """A spawned process: poll, wait with a timeout, signal (what Popen offers, for posix_spawn)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)
