"""What systemd does around a service's processes that PidOne alone does not: ExecStopPost= run
after each exit with $SERVICE_RESULT, $EXIT_CODE and $EXIT_STATUS set as systemd sets them, and
Restart=on-failure with RestartPreventExitStatus=: start after start on the one held socket, so
that clients waiting in its backlog are answered by whichever start reaches READY.

The unit's ExecStopPost= is `edge record-stop --config <config>` (edge.host.units); this runs the
same command line after every exit of the service.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kit.configs import EDGE
from harness.pid1 import PidOne

__all__ = ["Exit", "Unit", "stop_post_env", "wait_stopped"]

# systemd's view of a process killed by these: it dumped core (SERVICE_RESULT=core-dump)
_DUMPS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE, signal.SIGQUIT,
          signal.SIGSYS, signal.SIGTRAP, signal.SIGXCPU, signal.SIGXFSZ}


def stop_post_env(returncode: int) -> dict[str, str]:
    """$SERVICE_RESULT, $EXIT_CODE, $EXIT_STATUS for a main process that ended with `returncode`
    (subprocess's convention: -N for signal N), as systemd.exec(5) describes them."""
    if returncode >= 0:
        return {"SERVICE_RESULT": "success" if returncode == 0 else "exit-code", "EXIT_CODE": "exited",
                "EXIT_STATUS": str(returncode)}
    sig = signal.Signals(-returncode)
    dumped = sig in _DUMPS
    return {"SERVICE_RESULT": "core-dump" if dumped else "signal", "EXIT_CODE": "dumped" if dumped else "killed",
            "EXIT_STATUS": sig.name.removeprefix("SIG")}


def wait_stopped(pid: int, timeout: float = 60.0) -> None:
    """Until `pid` is stopped (SIGSTOP: EDGE_TEST_FAULT=<phase>:STOP stops the service as that
    phase begins, so that a test can send a signal from outside at a known phase)."""
    import threading
    import time

    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not stop in {timeout} s")
        threading.Event().wait(0.01)


@dataclass
class Exit:
    """One process's end: its code (-N: signal N), what record-stop printed, its log's tail."""

    returncode: int
    recorded: str
    log: str


@dataclass
class Unit:
    """A unit of one `edge serve` on `pid1`'s socket with `config`."""

    pid1: PidOne
    config: Path
    no_restart: tuple[int, ...] = (65, 76, 77, 78)
    exits: list[Exit] = field(default_factory=list)

    def stop_post(self, returncode: int, **overrides: str) -> Exit:
        """ExecStopPost= after an exit: `edge record-stop`, with systemd's variables."""
        env = {**os.environ, **stop_post_env(returncode), **overrides}
        r = subprocess.run([*EDGE, "record-stop", "--config", str(self.config)], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr  # record-stop never fails the unit's stop
        done = Exit(returncode, r.stderr, self.pid1.log_tail())
        self.exits.append(done)
        return done

    def signal_stopped(self, sig: int, **overrides: str) -> Exit:
        """One start that stops itself (EDGE_TEST_FAULT `<phase>:STOP`), sent `sig` from outside
        (then SIGCONT), then ExecStopPost= with `overrides` (SERVICE_RESULT=timeout, say)."""
        child = self.pid1.start()
        wait_stopped(child.pid)
        child.send_signal(sig)
        child.send_signal(signal.SIGCONT)
        return self.stop_post(child.wait(60), **overrides)

    def start_once(self, timeout: float = 120.0) -> bool:
        """One start: True once it sent READY=1; False when it exited before (ExecStopPost= ran)."""
        child = self.pid1.start()
        try:
            self.pid1.wait_for("READY", "1", pid=child.pid, timeout=timeout)
            return True
        except RuntimeError:  # it exited before READY (PidOne saw it)
            self.stop_post(child.wait(30))
            return False

    def start_until_ready(self, max_starts: int, timeout: float = 120.0) -> bool:
        """Restart=on-failure: start until one sends READY=1 (True), or one exits with a code that
        prevents restarts (False). Fails the test after `max_starts` starts."""
        for _ in range(max_starts):
            if self.start_once(timeout):
                return True
            if self.exits[-1].returncode in self.no_restart:
                return False
        raise AssertionError(f"no READY=1 in {max_starts} starts: exits {[e.returncode for e in self.exits]}")

    def stop(self, sig: int = signal.SIGTERM) -> Exit:
        """Stop the service (systemctl stop) and run ExecStopPost=."""
        return self.stop_post(self.pid1.stop(sig))
