"""Every file-system operation the installer makes goes through Fs, so a test can count them and
kill the process at the N-th one (kill -9 at every point, not only at named steps):
  EDGE_OTA_FS_LOG=<file>    append "N op path" for each operation (count them once)
  EDGE_OTA_KILL_AT_OP=<N>   os._exit(137) just before operation N (what kill -9 leaves behind)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO

__all__ = ["Fs"]


class Fs:
    def __init__(self) -> None:
        self.count = 0
        self._kill_at = int(os.environ.get("EDGE_OTA_KILL_AT_OP") or 0)
        self._log = os.environ.get("EDGE_OTA_FS_LOG")

    def op(self, name: str, path: Path | str) -> None:
        self.count += 1
        if self._log:
            with open(self._log, "a") as f:
                f.write(f"{self.count} {name} {path}\n")
        if self.count == self._kill_at:
            os._exit(137)

    def mkdir(self, path: Path) -> None:
        self.op("mkdir", path)
        path.mkdir(parents=True, exist_ok=True)

    def create(self, path: Path) -> BinaryIO:
        self.op("create", path)
        return open(path, "wb")

    def write(self, f: BinaryIO, data: bytes) -> None:
        self.op("write", f.name)
        f.write(data)

    def fsync(self, f: BinaryIO) -> None:
        self.op("fsync", f.name)
        f.flush()
        os.fsync(f.fileno())

    def fsync_dir(self, path: Path) -> None:
        self.op("fsync_dir", path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_file(self, path: Path, data: bytes) -> None:
        """Create, write and fsync (the caller renames it into place or fsyncs the dir)."""
        with self.create(path) as f:
            self.write(f, data)
            self.fsync(f)

    def atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.write_file(tmp, data)
        self.replace(tmp, path)
        self.fsync_dir(path.parent)

    def replace(self, src: Path, dst: Path) -> None:
        self.op("rename", f"{src} -> {dst}")
        os.replace(src, dst)

    def symlink(self, target: str, path: Path) -> None:
        self.op("symlink", path)
        os.symlink(target, path)

    def unlink(self, path: Path) -> None:
        self.op("unlink", path)
        path.unlink(missing_ok=True)

    def rmtree(self, path: Path) -> None:
        self.op("rmtree", path)
        shutil.rmtree(path, ignore_errors=True)
