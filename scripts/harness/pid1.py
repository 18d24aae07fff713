"""A stand-in for PID 1, for tests and benchmarks: what systemd does for a socket-activated
Type=notify service, done in-process.

It binds the listening socket once and keeps it for its whole life, starts the service with the
socket as fd 3 and LISTEN_FDS/LISTEN_PID set (LISTEN_PID is the child's own pid: a shell sets it
to $$ and then execs the service), and receives sd_notify datagrams on its own NOTIFY_SOCKET with
the sender's pid (SCM_CREDENTIALS). Stopping and starting the service again on the same socket
is exactly a systemd restart: connections made meanwhile wait in the socket's backlog.

It follows `MAINPID=` as systemd does under `NotifyAccess=all`: a notification naming another
pid makes that process the service (`proc`), as a handover's old process says of the new one it
started (edge.lifecycle.handover.handover). So that the new process, orphaned when the old one exits, is
reaped here, the test process is a child subreaper (PR_SET_CHILD_SUBREAPER), as systemd is.

A death is noticed at once: a reaper thread per child blocks in waitpid() and wakes every waiter,
so `wait_for`, `wait_count` and `while_running` (a request sent to the service) fail within
milliseconds with `ServiceExited`: the exit status or signal and the tail of the service's log,
never a timeout on a socket nobody will answer. A service started here dies with the process
that started it: it runs under `setpriv --pdeathsig KILL` (PR_SET_PDEATHSIG), spawned by one
long-lived thread of its PidOne (the signal fires when the spawning *thread* ends, so a start()
called from a short-lived thread must not spawn it itself), and in its own process group, which
close() kills. `dies_with_us(argv)` gives any other command the same death signal.
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

__all__ = ["Child", "Notification", "PidOne", "ServiceExited", "describe_status", "dies_with_us"]

T = TypeVar("T")
SETPRIV = shutil.which("setpriv")  # util-linux (scripts/setup installs it)


def dies_with_us(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGKILL when the thread that spawns it ends (PR_SET_PDEATHSIG):
    a test process killed mid-test leaves no service behind. Spawn it from a thread that lives
    as long as the command should (the main thread, or PidOne's spawner)."""
    return [SETPRIV, "--pdeathsig", "KILL", "--", *argv] if SETPRIV else list(argv)


def describe_status(returncode: int) -> str:
    """"was killed by SIGSEGV" / "exited with status 78": how a process ended, from its return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ServiceExited(RuntimeError):
    """The service exited while something waited on it: how it ended, and its log's tail."""

    def __init__(self, pid: int, returncode: int, waiting_for: str, log_tail: str) -> None:
        self.pid, self.returncode, self.log_tail = pid, returncode, log_tail
        super().__init__(f"the service (pid {pid}) {describe_status(returncode)} before {waiting_for}; "
                         f"its log ends:\n{log_tail}")


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
        self.mainpids: list[int] = []  # every pid MAINPID= named, in order
        self._pgid: int | None = None  # the first child's process group: what it starts is in it too
        _become_subreaper()
        self._spawns: queue.Queue = queue.Queue()  # (argv, env, file actions, reply queue) | None
        self._spawner = threading.Thread(target=self._spawn_loop, name="pid1-spawner", daemon=True)
        self._spawner.start()

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
                self._follow(fields.get("MAINPID"))
                self._cond.notify_all()

    def _follow(self, mainpid: str | None) -> None:
        """MAINPID=<pid> naming another process than the current one: that one is the service now."""
        if not mainpid or not mainpid.isdigit() or self.proc is None or int(mainpid) == self.proc.pid:
            return
        self.mainpids.append(int(mainpid))
        self.proc = Child(int(mainpid), self._cond, adopted_from=self.proc)

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
                self._raise_if_exited(f"{key}={value}" if value is not None else key)
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
                self._raise_if_exited(f"{count} {key} notifications ({len(got)} came)")
                if left <= 0:
                    raise TimeoutError(f"{len(got)} of {count} {key} notifications: {self.log_tail()}")
                self._cond.wait(min(left, 0.2))

    # -- the service's life ------------------------------------------------------------------
    def _raise_if_exited(self, waiting_for: str) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is not None:
            raise ServiceExited(proc.pid, proc.returncode, waiting_for, self.log_tail())  # type: ignore[arg-type]

    def while_running(self, fn: Callable[..., T], *args: object, timeout: float = 300.0,
                      what: str = "an answer") -> T:
        """fn(*args) — a request to the service — run in a thread: its result, or ServiceExited as
        soon as the service exits before it returns (a request waiting in the backlog of a dead
        service would otherwise wait for its own timeout); TimeoutError after `timeout`."""
        done: list = []
        exc: list[BaseException] = []

        def run() -> None:
            try:
                done.append(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                exc.append(e)
            with self._cond:
                self._cond.notify_all()

        threading.Thread(target=run, name="pid1-request", daemon=True).start()
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done and not exc:
                self._raise_if_exited(what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} from the service in {timeout} s: {self.log_tail()}")
                self._cond.wait(left)
        if exc:  # a connection the service took and then lost: its death is the news, if it died
            proc = self.proc
            if proc is not None:
                try:
                    proc.wait(1.0)  # the reaper's event: set within ms of a death
                except TimeoutError:
                    raise exc[0] from None
                raise ServiceExited(proc.pid, proc.returncode, what, self.log_tail()) from exc[0]  # type: ignore[arg-type]
            raise exc[0]
        return done[0]

    def _spawn_loop(self) -> None:
        """Every service this PidOne starts is spawned here, on one thread that lives until
        close(): PR_SET_PDEATHSIG fires when the spawning thread ends, not the process."""
        while (job := self._spawns.get()) is not None:
            argv, env, actions, reply = job
            try:
                reply.put(os.posix_spawn(argv[0], argv, env, file_actions=actions, setpgroup=0))
            except OSError as e:
                reply.put(e)

    def start(self) -> "Child":
        env = {**self.env, "LISTEN_FDS": "1", "NOTIFY_SOCKET": self.notify_path}
        env.pop("LISTEN_PID", None)
        env.pop("WATCHDOG_PID", None)
        if self.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.watchdog_usec)
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        # The shell's $$ is the pid that exec keeps (setpriv execs too): that is what LISTEN_PID must name.
        script = ('export LISTEN_PID=$$; if [ -n "$WATCHDOG_USEC" ]; then export WATCHDOG_PID=$$; fi; '
                  'exec "$@"')
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2),
                   (os.POSIX_SPAWN_DUP2, self.listener.fileno(), 3)]  # dup2 clears close-on-exec
        reply: queue.Queue = queue.Queue()
        try:
            self._spawns.put((["/bin/sh", "-c", script, "sh", *dies_with_us(self.argv)], env, actions, reply))
            pid = reply.get()
        finally:
            os.close(log)
        if isinstance(pid, OSError):
            raise pid
        self.proc = Child(pid, self._cond)
        self._pgid = pid
        return self.proc

    @property
    def pgid(self) -> int | None:
        """The process group of the service's processes (the first one's, which those it starts share)."""
        return self._pgid

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
            try:
                os.killpg(self._pgid or self.proc.pid, signal.SIGKILL)  # the service's group: what it started too
            except ProcessLookupError:
                pass
            self.stop(signal.SIGKILL, timeout=10)
        self._spawns.put(None)
        self._spawner.join()
        self._closed = True
        self._notify.close()
        self.listener.close()
        self._dir.cleanup()

    def __enter__(self) -> "PidOne":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process rather than to init (prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


class Child:
    """A spawned process: poll, wait with a timeout, signal (what Popen offers, for posix_spawn).
    A reaper thread waits for its exit and wakes everyone waiting on `cond` at once."""

    def __init__(self, pid: int, cond: threading.Condition | None = None, adopted_from: "Child | None" = None) -> None:
        self.pid = pid
        self.adopted_from = adopted_from  # MAINPID=: another process's child, ours once that one exits
        self.returncode: int | None = None
        self.exited_at: float | None = None  # time.monotonic() when it was reaped
        self._exited = threading.Event()
        self._cond = cond
        threading.Thread(target=self._reap, name=f"pid1-reaper-{pid}", daemon=True).start()

    def _reap(self) -> None:
        self.returncode = self._wait_adopted() if self.adopted_from is not None else \
            os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.exited_at = time.monotonic()
        self._exited.set()
        if self._cond is not None:
            with self._cond:
                self._cond.notify_all()

    def _wait_adopted(self) -> int:
        """A process another one started: its end seen through a pidfd; its status once it is our
        child (the one that started it exited: this process is their subreaper). 255 when its
        parent reaped it first."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return 255
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        for _ in range(2):
            try:
                return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:  # still the old process's child: ours once it has exited
                if self.adopted_from is not None:
                    self.adopted_from._exited.wait(60)
        return 255

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # reaped a moment ago, before _exited was set: gone already
                pass
