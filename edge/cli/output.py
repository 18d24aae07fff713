"""Where a command's answer goes, for every command at once: stdout, and the files commands write.

A command answers after it did its work. When stdout cannot take the answer (closed with `>&-`,
a file on a full file system, a reader that went away), the work stands, but exit 0 would say
the answer arrived: `guard()` puts a stdout in place whose writes never raise and remember the
first failure, and `settle()` turns a command's 0 into 74 (EX_IOERR) with one line on stderr. A
command that failed keeps its own code (its verdict is worth more than the lost answer). No
traceback either way: a failed write is neither an exception in the command nor one at exit.

`write_output()` is the one way a command writes a file it was asked for (`--output`): a temp
file beside it, fsynced, renamed over it; a full file system leaves the old file as it was.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from edge.errors import EdgeError

__all__ = ["EX_IOERR", "OutputLost", "Stdout", "guard", "settle", "write_output"]

EX_IOERR = 74


class OutputLost(EdgeError):
    """A file the command was asked to write could not be written (the old one stands)."""

    exit_code = EX_IOERR


class Stdout(io.RawIOBase):
    """fd 1 for the command's own sys.stdout: every write lands, or the first reason it did not is
    kept (and what follows is dropped: the answer is lost already, and a half answer is no better)."""

    def __init__(self, fd: int, closed: bool) -> None:
        super().__init__()
        self.fd = fd
        self.lost: str | None = "stdout is closed" if closed else None
        self.wanted = False  # something was written (or tried to be)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.lost is None and os.isatty(self.fd)

    def fileno(self) -> int:
        return self.fd

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        self.wanted = self.wanted or len(view) > 0
        done = 0
        while self.lost is None and done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except InterruptedError:
                continue
            except OSError as exc:
                self.lost = f"stdout: {exc.strerror or exc}"
        return len(view)


def guard() -> Stdout:
    """The command's stdout from now on (edge.cli.main, before the command runs). Python left
    sys.stdout None where fd 1 was closed at exec (edge.cli.main then gave fd 1 /dev/null)."""
    old = sys.stdout
    raw = Stdout(1, closed=old is None)
    line = bool(getattr(old, "line_buffering", False)) or raw.isatty()
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors=getattr(old, "errors", None) or "strict", line_buffering=line)
    return raw


def settle(raw: Stdout, code: int) -> tuple[int, str | None]:
    """(the exit code, a line for stderr or None) once the command ended with `code`."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a command closed it: what it wrote went through Stdout already
        pass
    if raw.lost is None or not raw.wanted or code != 0:
        return code, None
    return EX_IOERR, f"{raw.lost}: the command completed, but its answer could not be written"


def write_output(path: Path, data: str | bytes) -> None:
    """A file a command was asked to write (`--output`), atomically (edge.fsutil.atomic_write)."""
    from edge.fsutil import atomic_write

    try:
        atomic_write(path, data)
    except OSError as exc:
        raise OutputLost(f"{path}: cannot write it: {exc.strerror or exc} (what was there is as it was)") from None
