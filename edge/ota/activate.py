"""Activators put the switched `current` version into service and say whether it is healthy.
RestartActivator restarts the service (a gap: clients wait in the backlog while the new
version starts); ReloadActivator asks the running service for a zero-gap reload (the new version
is loaded and warmed beside the old one and takes traffic only once its warm-up succeeded, so a
bad bundle is never served and costs no gap). While waiting for the health URL, a ServiceWatch notices a service that exited or a
unit that failed at once, and its own last error becomes the reason for the rollback.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Activator", "ServiceWatch", "ReloadActivator", "RestartActivator", "SystemdWatch", "PidWatch",
           "activation_report", "command_activator", "run_activation", "systemd_activator", "unit_state_dirs"]


class Activator(Protocol):
    def activate(self) -> tuple[bool, str]:
        """Put `current` into service; (healthy?, why not, with the service's own error)."""


class ServiceWatch(Protocol):
    def failed(self) -> str | None:
        """None while the service runs (or starts); else what it said when it died."""


def _tail(text: str, n: int = 600) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-8:] if line.strip())[-n:]


@dataclass
class SystemdWatch:
    unit: str

    def failed(self) -> str | None:
        r = subprocess.run(["systemctl", "show", self.unit, "-p", "ActiveState,Result,ExecMainStatus"],
                           capture_output=True, text=True, timeout=30)
        props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        if props.get("ActiveState") not in ("failed", "inactive"):
            return None
        log = subprocess.run(["journalctl", "-u", self.unit, "-n", "15", "--no-pager", "-o", "cat"],
                             capture_output=True, text=True, timeout=30).stdout
        return (f"{self.unit} {props.get('ActiveState')} (result {props.get('Result')}, exit status "
                f"{props.get('ExecMainStatus')}): {_tail(log)}")


@dataclass
class PidWatch:
    """A service started by a restart command that writes its pid (and its output) to files."""

    pid_file: Path
    log_file: Path | None = None

    def failed(self) -> str | None:
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None  # not written yet: still starting
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie has exited too
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return None
        except (ProcessLookupError, FileNotFoundError):
            pass
        except PermissionError:
            return None
        log = ""
        if self.log_file is not None:
            try:
                log = self.log_file.read_text(errors="replace")[-4000:]
            except OSError:
                pass
        return f"the service (pid {pid}) exited: {_tail(log) or 'no output'}"


@dataclass
class RestartActivator:
    cmd: str
    health_url: str
    timeout: float
    watch: ServiceWatch | None = None

    def activate(self) -> tuple[bool, str]:
        ok, why = self._restart()
        if not ok:
            died = self.watch.failed() if self.watch else None
            return False, f"{why}; {died}" if died else why
        return self._wait_ready()

    def _restart(self) -> tuple[bool, str]:
        import tempfile  # here: a service's start imports this module (edge.cli.launch's OTA check)

        # Output goes to a file, not a pipe: a service the command leaves running in the
        # background would hold a pipe open and make the restart look hung.
        with tempfile.TemporaryFile() as out:
            try:
                r = subprocess.run(self.cmd, shell=True, stdin=subprocess.DEVNULL, stdout=out,  # noqa: S602
                                   stderr=subprocess.STDOUT, timeout=self.timeout)
            except subprocess.TimeoutExpired:
                return False, f"`{self.cmd}` did not finish within {self.timeout:.0f} s"
            out.seek(0)
            text = out.read().decode(errors="replace")
        if r.returncode != 0:
            return False, f"`{self.cmd}` exited {r.returncode}: {_tail(text, 300)}"
        return True, ""

    def _wait_ready(self) -> tuple[bool, str]:
        import urllib.request  # here: the HTTP client's imports are an activation's, never a start's

        deadline, last = time.monotonic() + self.timeout, "no answer"
        while time.monotonic() < deadline:
            died = self.watch.failed() if self.watch else None
            if died:
                return False, died
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as r:  # noqa: S310 - loopback URL
                    if r.status == 200:
                        return True, ""
                    last = f"HTTP {r.status}"
            except OSError as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.2)  # poll interval of a real condition (the health URL), not a wait for time
        return False, f"{self.health_url} not ready within {self.timeout:.0f} s ({last})"


def command_activator(cmd: str, health_url: str, timeout: float, pid_file: Path | None = None,
                      log_file: Path | None = None) -> RestartActivator:
    watch = PidWatch(pid_file, log_file) if pid_file else None
    return RestartActivator(cmd, health_url, timeout, watch)


def systemd_activator(unit: str, health_url: str, timeout: float) -> RestartActivator:
    # For a Type=notify unit, `systemctl restart` returns only once READY=1 came, or the start failed.
    return RestartActivator(f"systemctl restart {unit}", health_url, timeout, SystemdWatch(unit))


def _answers(path: Path) -> bool:
    """A service listens on this control socket (a connection is accepted)."""
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(path.stat().st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(path))
        return True
    except OSError:
        return False


def unit_state_dirs(unit: str) -> list[Path]:
    """The state directories systemd gives `unit` (StateDirectory=), where it can say."""
    try:
        r = subprocess.run(["systemctl", "show", unit, "-p", "StateDirectory", "--value"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [Path("/var/lib") / name for name in r.stdout.split()] if r.returncode == 0 else []


@dataclass
class ReloadActivator:
    """Activation by `edge reload`: the running service loads `config` (the OTA `current` link's
    edge.toml, which now names the new version) beside what it serves, warms it over its real
    HTTP path, and switches only then. Healthy = the switch happened; otherwise the old version
    never stopped serving, and the service's own error is the reason. A rollback is the same
    call after the links went back.

    The service's control socket is in *its* state directory, which the serving config (or its
    unit) decides, not the installer's: `candidates` are (socket, where that guess comes from),
    and `check()` picks the one a service answers on before anything is switched."""

    config: Path
    candidates: list[tuple[Path, str]]
    timeout: float
    control: Path | None = None
    report: dict[str, Any] | None = None  # the last reload's report: kept, loaded, mode

    def check(self) -> None:
        if self.control is not None:
            return
        for path, _ in self.candidates:
            if _answers(path):
                self.control = path
                return
        from edge.ota.errors import ServiceUnreachable

        looked = "; ".join(f"{p} ({why})" for p, why in self.candidates)
        raise ServiceUnreachable(f"reload activation: no running edge service answers on a control socket; "
                                 f"looked at {looked}. Nothing was switched: start the service, or pass "
                                 "--control <its state_dir>/control.sock")

    def activate(self) -> tuple[bool, str]:
        from edge.errors import EdgeError
        from edge.lifecycle.control import request_reload

        try:
            self.check()
            answer = request_reload(self.control, str(self.config.resolve()), self.timeout)  # type: ignore[arg-type]
        except EdgeError as exc:
            return False, f"reload: {exc}"
        self.report = answer.get("report")
        if answer.get("ok"):
            return True, ""
        return False, f"reload refused the version (exit {answer.get('exit_code')}): {answer.get('error')}"


def run_activation(act: Any) -> tuple[bool, str]:
    """An Activator, or a plain callable (tests and embedders): (healthy?, why not)."""
    return act.activate() if hasattr(act, "activate") else act()


def activation_report(act: Any) -> dict[str, Any]:
    """What a reload activation did (kept, loaded, mode), for the command's answer."""
    report = getattr(act, "report", None)
    return {"reload": {k: report.get(k) for k in ("kept", "loaded", "mode")}} if report else {}
