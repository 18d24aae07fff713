"""The file-system steps every atomic write in edge is made of: hash, fsync, rename; a file's
identity, by which edge knows a file it has seen without reading it again; and the modes of what
edge writes.

What edge writes for itself can hold a prompt (start and reload reports, warm-up plans with
the workload's prompts, saved prompt states whose token ids decode back to the prompt), a crash's
details (the start journals, crash records) or a device's history: `atomic_write`
makes each file 0600 and `private_dir` each folder 0700, whatever the umask (the unit's
`UMask=0077` covers the unit only; `edge serve` from a shell runs with the user's). What is
written for others to read says so: the units (0644), an engine (the umask's: a store built by
root is read by the service's own user), a file a person asked for (the umask's)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PRIVATE", "atomic_write", "cannot_create", "file_identity", "fsync_dir", "private_dir", "sha256_file",
           "write_probe"]

PRIVATE = 0o600  # atomic_write's mode unless told otherwise: the writer alone may read it


def sha256_file(path: Path) -> str:
    import hashlib  # here: every start imports this module before its config

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_identity(path: str | os.PathLike[str], *, ctime: bool = False) -> tuple[int, ...]:
    """(device, inode, size, mtime in ns): the same file, unchanged, while these are; with `ctime`
    also its change time, which moves on every write and every metadata change (a `touch -m` that
    sets an old mtime back included). Raises OSError where the file cannot be stat'ed."""
    st = os.stat(path)
    found = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return (*found, st.st_ctime_ns) if ctime else found


def fsync_dir(d: Path) -> None:
    """Make the renames in `d` durable (a power cut after the rename keeps it)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | bytearray | str | Sequence[bytes | bytearray],
                 mode: int | None = PRIVATE) -> None:
    """Write a hidden temp file beside `path`, fsync it, rename it over `path`, fsync the dir.
    `data` may be a sequence of chunks (written one after another, never joined in memory).
    The file has `mode` exactly, from its creation on (0600 unless told otherwise; None: what
    the umask gives). A write that fails (a full disk) leaves `path` as it was and removes its
    temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    chunks = [data.encode()] if isinstance(data, str) else [data] if isinstance(data, (bytes, bytearray)) else data
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # an earlier process's with this pid: created anew, never reused with its mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE if mode is not None else 0o666)
        with open(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly this, whatever the umask took off
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def private_dir(path: Path) -> Path:
    """`path` as a folder only its owner may enter: each folder made here (parents included) is
    0700 whatever the umask, and an existing one this user owns is made 0700 if it was more open
    (a folder of an earlier edge, whose files may be 0644). Returns `path`."""
    made = False
    for d in [d for d in [path, *path.parents] if not d.exists()][::-1]:
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by another process: checked below as an existing one
        os.chmod(d, 0o700)  # the umask may have taken more off
        made = d == path
    if not made:
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(path, 0o700)
    return path


def cannot_create(path: Path) -> str | None:
    """Why a file cannot be written at `path` (a folder there, its folder missing or not
    writable), by a real file made and removed beside it; None when it can. The file at `path`
    itself, if any, is left alone."""
    if path.is_dir():
        return f"{path} is a directory; expected a file name"
    folder = path.parent
    if not folder.is_dir():
        return f"{path}: its folder {folder} does not exist"
    probe = folder / f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.probe"  # tempfile's way, without its imports
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return f"{path}: cannot write in {folder}: {exc.strerror or exc}"
    return None


def write_probe(path: Path) -> str | None:
    """None if a file can be created, fsynced and removed in `path` (made if missing), else why not."""
    if path.exists() and not path.is_dir():
        return "not a folder"
    try:
        if not path.is_dir():  # made by edge: its own, 0700 (it will hold reports, prompts' states, crashes)
            private_dir(path)
        name = path / f".edge-write-probe-{os.getpid()}-{os.urandom(6).hex()}"  # mkstemp's way, without tempfile
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"edge")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
