"""The memory limit of the cgroup a process runs in: systemd's `MemoryMax=`/`MemoryHigh=` of its
unit or slice, a container's limit. Beyond `memory.max` the kernel OOM-kills; beyond `memory.high`
it throttles the cgroup and reclaims hard, which a locked model cannot give back.

- cgroup v2 (`0::<path>` in /proc/<pid>/cgroup): /sys/fs/cgroup/<path>/memory.max, memory.high,
  memory.current, memory.stat (under /sys/fs/cgroup/unified on a hybrid host);
- cgroup v1 (a line naming the `memory` controller): /sys/fs/cgroup/memory/<path>/
  memory.limit_in_bytes, memory.usage_in_bytes, memory.stat.

The cgroup's ancestors limit it too (a slice's MemoryMax= holds every service in it), and their
usage counts every process below them, so the room of each level is its limit less its usage, and
the smallest room binds. Usage is the working set: page cache the kernel may drop at once
(`inactive_file`) does not count, as kubelet and cAdvisor reckon it.

Test double: $EDGE_TEST_CGROUP_ROOT (`TEST_CGROUP_ROOT_ENV`) names a tree with the same layout
(proc/self/cgroup, sys/fs/cgroup/...), read in place of `/`: the same parsing, other files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["CgroupLimit", "TEST_CGROUP_ROOT_ENV", "memory_limit", "oom_kills"]

TEST_CGROUP_ROOT_ENV = "EDGE_TEST_CGROUP_ROOT"  # test double: a fixture tree read in place of /
UNLIMITED_V1 = 1 << 62  # v1 writes "no limit" as PAGE_COUNTER_MAX pages in bytes (about 2^63)
MIB = 1 << 20
# version -> (limit files, usage file, memory.stat field of the dropable page cache)
FILES = {2: (("memory.max", "memory.high"), "memory.current", "inactive_file"),
         1: (("memory.limit_in_bytes",), "memory.usage_in_bytes", "total_inactive_file")}


@dataclass(frozen=True)
class CgroupLimit:
    """The limit that leaves the least room: which cgroup, which file, its value, what is used."""

    cgroup: str  # /system.slice/edge.service
    setting: str  # memory.max | memory.high | memory.limit_in_bytes
    limit: int  # bytes
    used: int  # bytes: the working set of the cgroup (usage less inactive page cache)
    version: int = 2

    @property
    def room(self) -> int:
        return max(self.limit - self.used, 0)

    def describe(self) -> str:
        return (f"{self.setting} of cgroup {self.cgroup} (v{self.version}): {self.limit / MIB:.0f} MiB, "
                f"{self.used / MIB:.0f} MiB in use")

    def as_dict(self) -> dict[str, Any]:
        return {"cgroup": self.cgroup, "setting": self.setting, "limit_mib": self.limit // MIB,
                "used_mib": self.used // MIB, "room_mib": self.room // MIB, "version": self.version}


def _root(root: str | Path | None) -> Path:
    return Path(root if root is not None else os.environ.get(TEST_CGROUP_ROOT_ENV) or "/")


def _membership(root: Path, pid: int | str) -> tuple[int, str] | None:
    """(cgroup version, path) of the memory controller of `pid`, from /proc/<pid>/cgroup."""
    try:
        lines = (root / "proc" / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return 1, path or "/"
        if controllers == "" and line.startswith("0::"):
            v2 = path or "/"
    return (2, v2) if v2 is not None else None


def _mount(root: Path, version: int) -> Path:
    base = root / "sys" / "fs" / "cgroup"
    if version == 1:
        return base / "memory"
    return base if (base / "cgroup.controllers").exists() else base / "unified"


def _number(path: Path) -> int | None:
    """The file's value in bytes; None where there is no limit ("max", v1's huge value) or no file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max"
    value = int(text)
    return None if value >= UNLIMITED_V1 else value


def _inactive_file(folder: Path, field: str) -> int:
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _levels(path: str) -> list[str]:
    """/a/b/c -> [/a/b/c, /a/b, /a, /]: the cgroup and every ancestor."""
    p = PurePosixPath(path if path.startswith("/") else "/" + path)
    return [str(p), *(str(a) for a in p.parents)]


def memory_limit(pid: int | str = "self", root: str | Path | None = None) -> CgroupLimit | None:
    """The limit of `pid`'s cgroup or of an ancestor that leaves the least room; None where no
    level has one (or the files cannot be read: no cgroup filesystem, another layout)."""
    where = _root(root)
    member = _membership(where, pid)
    if member is None:
        return None
    version, path = member
    limits, usage_file, dropable = FILES[version]
    mount = _mount(where, version)
    best: CgroupLimit | None = None
    for level in _levels(path):
        folder = mount / level.lstrip("/")
        usage = _number(folder / usage_file)
        for setting in limits:
            limit = _number(folder / setting)
            if limit is None:
                continue
            used = max((usage or 0) - _inactive_file(folder, dropable), 0)
            found = CgroupLimit(level, setting, limit, used, version)
            if best is None or found.room < best.room:
                best = found
    return best


def oom_kills(pid: int | str = "self", root: str | Path | None = None) -> int | None:
    """How many processes the kernel's OOM killer has killed in `pid`'s cgroup so far (cgroup v2
    `memory.events` oom_kill; v1 `memory.oom_control` oom_kill); None where it cannot be read.
    A count read at a start and again when the service ended tells an OOM kill from another
    SIGKILL (edge.fleet.crashes)."""
    where = _root(root)
    member = _membership(where, pid)
    if member is None:
        return None
    version, path = member
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        text = (_mount(where, version) / path.lstrip("/") / name).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
