"""What is installed on disk against what this process runs: the three things only a new process
picks up, and so the reasons `edge reload` hands the service over to a new process
(edge.lifecycle.handover.handover) rather than reloading in place.

- edge itself: `__version__` of the package's `__init__.py` on disk (where this process imported
  it from; a package update replaces it there) against the one in memory;
- llama.cpp: the libraries this process has mapped (/proc/self/maps) against the files now at
  those paths: a file removed or replaced by rename shows " (deleted)"; one written anew or in
  place at the same path has another stat() identity (device, inode, size, mtime) than it had
  when the start noted it. stat() is compared with stat(), never with the maps' device and
  inode: on overlayfs (every container) those name the layer's file, stat() the overlay's, and
  every reload would look like an upgrade;
- the unit's environment: systemd starts ExecReload= (`edge reload`) in the unit's environment as
  it is *now* (after `systemctl daemon-reload`), so the environment `edge reload` sends is the
  unit's; it is compared with the one this process started with, and only when both belong to
  the same unit invocation ($INVOCATION_ID): a shell's environment says nothing about the unit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edge.fsutil import file_identity

__all__ = ["PER_PROCESS", "Running", "installed_version", "mapped_files", "mapped_libraries", "unit_environment"]

# Set by systemd (or a shell, or edge) for one process: never a difference between two of them.
PER_PROCESS = frozenset({
    "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
    "MAINPID", "MANAGERPID", "SYSTEMD_EXEC_PID", "JOURNAL_STREAM", "INVOCATION_ID", "PIDFILE",
    "MONITOR_SERVICE_RESULT", "MONITOR_EXIT_CODE", "MONITOR_EXIT_STATUS", "MONITOR_INVOCATION_ID",
    "MONITOR_UNIT", "SERVICE_RESULT", "EXIT_CODE", "EXIT_STATUS", "EDGE_HANDOVER_FD", "_", "PWD",
    "OLDPWD", "SHLVL"})


def unit_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` without what belongs to one process only."""
    return {k: v for k, v in env.items() if k not in PER_PROCESS}


def installed_version(package_dir: Path) -> str | None:
    """`__version__` as `<package_dir>/__init__.py` assigns it now (None: unreadable)."""
    from edge.device.identity import assigned_version  # at a reload only: not on the start's path

    return assigned_version(package_dir / "__init__.py")


def _maps() -> Iterator[tuple[str, int, int]]:
    """(path, device, inode) of every file this process has mapped, from /proc/self/maps (a path
    whose file is gone since ends in " (deleted)")."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[4] == "0":
            continue
        major, _, minor = parts[3].partition(":")
        try:
            yield parts[5], os.makedev(int(major, 16), int(minor, 16)), int(parts[4])
        except ValueError:
            continue


def mapped_libraries(prefixes: tuple[str, ...] = ("libllama", "libggml", "libmtmd")) -> dict[str, tuple[int, int]]:
    """The libraries this process has mapped whose names start with `prefixes`: path → (device,
    inode) of what was mapped; a path whose file is gone since ends in " (deleted)"."""
    return {path: (dev, ino) for path, dev, ino in _maps()
            if Path(path.removesuffix(" (deleted)")).name.startswith(prefixes)}


@dataclass
class Running:
    """What this process runs: taken as `edge serve` begins (the environment before anything
    changes it), compared with what is on disk at each reload."""

    version: str
    package_dir: Path
    environment: dict[str, str] = field(default_factory=dict)
    invocation: str | None = None
    libraries: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # path -> stat identity

    def note_libraries(self) -> None:
        """What the llama.cpp libraries this process has mapped are on disk now (once they are
        loaded: the start calls it after its models are)."""
        for path in mapped_libraries():
            if not path.endswith(" (deleted)") and path not in self.libraries:
                identity = _identity(path)
                if identity is not None:
                    self.libraries[path] = identity

    @classmethod
    def now(cls) -> "Running":
        import edge

        return cls(edge.__version__, Path(edge.__file__).resolve().parent, unit_environment(dict(os.environ)),
                   os.environ.get("INVOCATION_ID"))

    def differences(self, client_env: dict[str, str] | None = None) -> list[str]:
        """Why a new process would run something else than this one: one line per difference."""
        why = []
        on_disk = installed_version(self.package_dir)
        if on_disk is not None and on_disk != self.version:
            why.append(f"edge {on_disk} is installed ({self.package_dir}), {self.version} runs")
        for path in mapped_libraries():
            if path.endswith(" (deleted)"):
                why.append(f"llama.cpp: {path.removesuffix(' (deleted)')} was replaced since it was loaded")
            elif path in self.libraries and _identity(path) not in (None, self.libraries[path]):
                why.append(f"llama.cpp: {path} was replaced since it was loaded")
        if client_env is not None and client_env.get("INVOCATION_ID") and \
                client_env.get("INVOCATION_ID") == self.invocation:
            new = unit_environment(client_env)
            changed = sorted(k for k in set(new) | set(self.environment) if new.get(k) != self.environment.get(k))
            if changed:
                why.append(f"the unit's environment changed: {', '.join(changed)}")
        return why

    def successor_environment(self, client_env: dict[str, str] | None) -> dict[str, str]:
        """The environment a new process gets: the unit's as `edge reload` sent it (same
        invocation), else this process's own."""
        if client_env is not None and client_env.get("INVOCATION_ID") == self.invocation and self.invocation:
            return unit_environment(client_env)
        return dict(self.environment)


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        return file_identity(path)
    except OSError:
        return None


def mapped_files() -> set[tuple[int, int] | str]:
    """Every file this process has mapped, as (device, inode) and as its path: on overlayfs
    (containers) the maps' device and inode are the layer's file, which stat() of the path does
    not give, so a file counts as mapped when either matches."""
    found: set[tuple[int, int] | str] = set()
    for path, dev, ino in _maps():
        found.add((dev, ino))
        if not path.endswith(" (deleted)"):
            found.add(path)
    return found
