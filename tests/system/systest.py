"""A real systemd 252 as PID 1 in a container, for the system suite.

`Machine` boots the cached Debian rootfs (rootfs.py) with `systemd-nspawn -b --private-network
--volatile=overlay` (the cached tree stays pristine: every boot writes to a tmpfs overlay) and
runs commands inside with `nsenter` into the container's PID 1 namespaces. The host's systemd is
not needed (nspawn runs with --register=no --keep-unit). Clients run on the host's Python inside
the container's network namespace only (`Machine.net`), so they reach the service on the
container's loopback and nothing else.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kit.docs import section

ROOT = Path(__file__).resolve().parents[2]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def why_not_bootable() -> str | None:
    """A reason the suite cannot run here, or None."""
    if os.geteuid() != 0:
        return "systemd-nspawn -b needs root"
    for tool in ("systemd-nspawn", "mmdebstrap", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} is missing (scripts/setup installs systemd-container and mmdebstrap)"
    return None


def wait_for(what: str, cond: Callable[[], object], timeout: float, step: float = 0.1) -> object:
    """Poll a real condition until it holds (returns its value) or `timeout` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class Machine:
    def __init__(self, rootfs: Path, name: str, binds: dict[str, str], log: Path) -> None:
        self.rootfs, self.name, self.binds, self.log = rootfs, name, binds, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def boot(self, timeout: float = 120) -> None:
        cmd = ["systemd-nspawn", "-q", "-b", "-D", str(self.rootfs), "--volatile=overlay",
               "--private-network", "--register=no", "--keep-unit", f"--machine={self.name}",
               # a device's PID 1 has CAP_SYS_RESOURCE, so LimitMEMLOCK=infinity takes effect;
               # only where the host has it to give (a host that lacks it: the limit stays 8 MiB)
               "--capability=CAP_SYS_RESOURCE"]
        cmd += [f"--bind-ro={host}:{guest}" for host, guest in self.binds.items()]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.leader = int(wait_for("the container's PID 1", self._find_leader, timeout))
        # PID 1 exists before its private bus socket does: retry until systemctl reaches it
        state = wait_for("systemd in the container to answer", lambda: self.run(
            "systemctl is-system-running --wait", check=False, timeout=timeout).stdout.strip(), timeout, 0.2)
        if state not in ("running", "degraded"):
            raise RuntimeError(f"the container's systemd is {state!r} after boot")

    def _find_leader(self) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        todo = _children(self.proc.pid)
        while todo:  # nspawn forks twice; PID 1 of the container is the one running systemd
            pid = todo.pop()
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return pid
            except OSError:
                continue
            todo += _children(pid)
        return None

    def run(self, script: str, *, check: bool = True, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a bash script inside the container (all namespaces of its PID 1), as root."""
        envs = [f"{k}={v}" for k, v in {"PATH": PATH, "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0",
                                          "SYSTEMD_PAGER": "", **(env or {})}.items()]
        cmd = ["nsenter", "-t", str(self.leader), "-a", "--", "/usr/bin/env", "-i", *envs,
               "/bin/bash", "-eo", "pipefail", "-c", script]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"in the container, `{script}` exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def net(self, argv: list[str], **kw) -> subprocess.Popen[str]:
        """Start a host program inside the container's network namespace only."""
        return subprocess.Popen(["nsenter", f"--net=/proc/{self.leader}/ns/net", "--", *argv], text=True, **kw)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def listen_backlog(self, port: int) -> int | None:
        """The backlog of the socket listening on `port` (ss -ltn: Send-Q of a listener)."""
        out = self.run(f"ss -Hltn 'sport = :{port}'").stdout
        m = re.search(r"LISTEN\s+\d+\s+(\d+)", out)
        return int(m.group(1)) if m else None

    def poweroff(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # nspawn -b turns it into an orderly shutdown
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def readme_systemd_steps() -> list[str]:
    """The command lines of the device's code block (the one that makes the venv) in docs/deploy.md's
    "From a wheel, without a checkout" section (found by its title, wherever the docs keep it),
    comments cut."""
    text = section("From a wheel, without a checkout")
    (block,) = [b for b in re.findall(r"^```\n(.*?)^```", text, re.M | re.S) if b.startswith("python3 -m venv")]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]
