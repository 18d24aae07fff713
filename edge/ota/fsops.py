"""Every file-system operation the installer makes goes through Fs, so a test can count them and
kill the process at the N-th one (kill -9 at every point, not only at named steps):
  EDGE_OTA_FS_LOG=<file>    append "N op path" for each operation (count them once)
  EDGE_OTA_KILL_AT_OP=<N>   os._exit(137) just before operation N (what kill -9 leaves behind)
  EDGE_OTA_ENOSPC_AT_OP=<N> operation N fails with ENOSPC (a file system that fills at that moment)

The writes that must succeed on a full file system (state, markers, link switches) use only
operations that allocate nothing: an overwrite in place of a file's existing bytes, and
renameat2(RENAME_EXCHANGE), which swaps two names atomically (as OSTree swaps its boot loader
directories); `rename_exchange` raises OSError(EINVAL) where the file system cannot.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
from pathlib import Path
from typing import BinaryIO

from edge.fsutil import fsync_dir

__all__ = ["DIR_MODE", "EXCHANGE_UNSUPPORTED", "Fs", "make_dirs", "rename_exchange"]

AT_FDCWD = -100
RENAME_EXCHANGE = 2
# glibc before 2.28 (Ubuntu 18.04, JetPack 4) has no renameat2(): the raw system call instead
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "armv7l": 382, "armv8l": 382, "riscv64": 276, "ppc64le": 357}
EXCHANGE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
DIR_MODE = 0o755


def rename_exchange(a: Path | str, b: Path | str) -> None:
    """Swap the names `a` and `b` (both must exist) in one atomic step."""
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_int(AT_FDCWD), os.fsencode(a), ctypes.c_int(AT_FDCWD), os.fsencode(b),
            ctypes.c_uint(RENAME_EXCHANGE))
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        rc = fn(*args)
    elif platform.machine() in _SYS_RENAMEAT2:
        rc = libc.syscall(ctypes.c_long(_SYS_RENAMEAT2[platform.machine()]), *args)
    else:
        raise OSError(errno.ENOSYS, f"renameat2 is not known on {platform.machine()}", str(a))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def make_dirs(path: Path) -> None:
    """`path` and its missing parents, DIR_MODE whatever the umask."""
    made = []
    while not path.is_dir():
        made.append(path)
        path = path.parent
    for d in reversed(made):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(d, DIR_MODE)


class Fs:
    def __init__(self) -> None:
        self.count = 0
        self._kill_at = int(os.environ.get("EDGE_OTA_KILL_AT_OP") or 0)
        self._full_at = int(os.environ.get("EDGE_OTA_ENOSPC_AT_OP") or 0)
        self._log = os.environ.get("EDGE_OTA_FS_LOG")

    def op(self, name: str, path: Path | str) -> None:
        self.count += 1
        if self._log:
            with open(self._log, "a") as f:
                f.write(f"{self.count} {name} {path}\n")
        if self.count == self._kill_at:
            os._exit(137)
        if self.count == self._full_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def mkdir(self, path: Path) -> None:
        """The folder and its missing parents, 0755 whatever the umask (the service, another
        user, reads versions it did not install: a unit's UMask=0077 applies to ExecStartPre=)."""
        self.op("mkdir", path)
        make_dirs(path)

    def create(self, path: Path, mode: int = 0o644) -> BinaryIO:
        """A new file of `mode` whatever the umask (as mkdir's)."""
        self.op("create", path)

        def opener(p: str, flags: int) -> int:
            fd = os.open(p, flags, mode)
            os.fchmod(fd, mode)
            return fd
        return open(path, "wb", opener=opener)

    def write(self, f: BinaryIO, data: bytes) -> None:
        self.op("write", f.name)
        f.write(data)

    def fsync(self, f: BinaryIO) -> None:
        self.op("fsync", f.name)
        f.flush()
        os.fsync(f.fileno())

    def fsync_dir(self, path: Path) -> None:
        self.op("fsync_dir", path)  # counted here; the fsync itself is edge's one (edge.fsutil)
        fsync_dir(path)

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

    def overwrite(self, path: Path, data: bytes) -> None:
        """Write `data` over the first bytes of an existing file and fsync: no new inode, and no
        new block where the file already has that many bytes (not on copy-on-write file systems)."""
        self.op("overwrite", path)
        fd = os.open(path, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.fsync(fd)
        finally:
            os.close(fd)

    def exchange(self, a: Path, b: Path) -> None:
        self.op("exchange", f"{a} <-> {b}")
        rename_exchange(a, b)

    def link(self, src: Path, dst: Path) -> None:
        """A hard link (of a symlink itself, not its target)."""
        self.op("link", f"{src} -> {dst}")
        os.link(src, dst, follow_symlinks=False)

    def copy(self, src: Path, dst: Path) -> None:
        self.op("copy", f"{src} -> {dst}")
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 8 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        shutil.copymode(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        self.op("rename", f"{src} -> {dst}")
        os.replace(src, dst)

    def chmod(self, path: Path, mode: int) -> None:
        """The mode of the file at `path` (a regular file: the caller checked), in place: no room
        needed."""
        self.op("chmod", path)
        os.chmod(path, mode)

    def symlink(self, target: str, path: Path) -> None:
        self.op("symlink", path)
        os.symlink(target, path)

    def unlink(self, path: Path) -> None:
        self.op("unlink", path)
        path.unlink(missing_ok=True)

    def rmtree(self, path: Path) -> None:
        self.op("rmtree", path)
        shutil.rmtree(path, ignore_errors=True)
