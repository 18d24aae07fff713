"""kill -9 at every file operation of a command, by the kernel (strace's syscall injection): no
hook in the code under test decides where it may die.

`record(argv, env, root)` runs the command once under strace, tracing every system call that
changes a file (and the spawn of a child: an activation), and returns its kill points: each such
call that touches a path under `root` (its path arguments, or the file behind its descriptor:
strace -y), and each spawn. `kill_at(argv, env, point)` runs the command again with SIGKILL
delivered as that call is entered (strace counts calls per system call and per process: the
point is "the N-th write", and the N-th call of the recorded run is the one), checks that it
died there, and returns. Runs are made alike: PYTHONHASHSEED fixed, no bytecode written.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Point", "kill_at", "pristine", "record", "strace"]

CHANGES = ("openat", "write", "pwrite64", "fsync", "fdatasync", "rename", "renameat", "renameat2", "link", "linkat",
           "unlink", "unlinkat", "mkdir", "mkdirat", "symlink", "symlinkat", "rmdir", "chmod", "fchmod",
           "fchmodat", "ftruncate", "truncate")
SPAWNS = ("vfork", "clone", "clone3")
WRITES = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC")  # an openat that is a file operation, not a read
_LINE = re.compile(r"^(\w+)\((.*)")


@dataclass(frozen=True)
class Point:
    syscall: str
    nth: int  # the N-th call of this system call in the process
    line: str  # as strace showed it (for messages)

    def where(self) -> str:
        """Its strings and paths: what identifies the call across runs (not pointers or sizes)."""
        line = self.line.split(" <unfinished ...>")[0].split(") = ")[0]
        said = " ".join(re.findall(r'"[^"]*"|<[^>]*>', line))
        return f"{self.syscall} " + re.sub(r"\d+", "#", said)  # temp names carry the pid


def strace() -> str | None:
    return shutil.which("strace")


def _env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def _calls(log: Path) -> list[tuple[str, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in CHANGES + SPAWNS:
            out.append((m.group(1), line))
    return out


def record(argv: list[str], env: dict[str, str], root: Path, log: Path,
           timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[Point]]:
    """The command's run under strace, and its kill points under `root`."""
    cmd = [strace() or "strace", "-qq", "-y", "-s", "16", "-e", f"trace={','.join(CHANGES + SPAWNS)}", "-o", str(log),
           "--", *argv]
    r = subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd="/")
    seen: dict[str, int] = {}
    points = []
    for name, line in _calls(log):
        seen[name] = seen.get(name, 0) + 1
        under = f'"{root}/' in line or f"<{root}/" in line  # a path argument, or the file behind a descriptor
        spawn = name in SPAWNS and "CLONE_THREAD" not in line  # a child (the activation), not a thread
        if spawn or (under and (name != "openat" or any(w in line for w in WRITES))):
            points.append(Point(name, seen[name], line))
    return r, points


def kill_at(argv: list[str], env: dict[str, str], point: Point, log: Path,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """The command again, SIGKILLed as `point` is entered; AssertionError where it died elsewhere
    (the runs differed before the point) or not at all."""
    cmd = [strace() or "strace", "-qq", "-y", "-s", "16", "-e", f"trace={point.syscall}", "-e",
           f"inject={point.syscall}:signal=SIGKILL:when={point.nth}", "-o", str(log), "--", *argv]
    r = subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd="/")
    assert r.returncode == -9, (point.where(), r.returncode, r.stderr[-2000:])
    calls = [line for name, line in _calls(log) if name == point.syscall]
    assert len(calls) == point.nth and Point(point.syscall, point.nth, calls[-1]).where() == point.where(), \
        (point.where(), calls[-1:] or "no call")
    return r


def pristine(src: Path, dst: Path) -> None:
    """`dst` made a copy of `src` with its hard links (the store's objects and the versions'
    files stay one inode: shutil.copytree would make copies of them)."""
    if os.path.lexists(dst):
        shutil.rmtree(dst)
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
