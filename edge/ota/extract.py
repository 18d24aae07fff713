"""Bounded extraction into the content store: never more bytes than the signed manifest
declares, per member and in total; free space (bytes and inodes) is checked before the first
byte is written, counting only content the store does not have. A member whose content the
store has is hashed as it streams by and written nowhere. `scan` hashes members streaming (for
`edge ota inspect` and an already-current install) without holding a member in memory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry, shown
from edge.ota.store import Store

__all__ = ["check_free_space", "extract_files", "refill", "scan", "HEADROOM"]

CHUNK = 1 << 20
HEADROOM = 1 << 20  # edge.toml, manifest.json, markers and directory blocks
FULL = (errno.ENOSPC, errno.EDQUOT)


def _needs(bundle: Bundle, store: Store, versions: Path) -> tuple[int, int]:
    """(bytes, inodes) the install writes: new objects, and copies where links are impossible."""
    new = {(f.sha256, f.size) for f in bundle.files if f.carried and not store.intact(f.sha256, f.size)}
    size = sum(s for _, s in new)
    if store.objects.is_dir() and os.stat(store.objects).st_dev != os.stat(versions).st_dev:
        size += bundle.total_size  # another file system: every file of the version is a copy
    dirs = {str(Path(f.path).parent) for f in bundle.files}
    # a hard link costs a dentry that tmpfs counts as an inode: one per file, not per object
    return size + HEADROOM, len(new) + len(bundle.files) + len(dirs) + 8


def check_free_space(bundle: Bundle, store: Store, versions: Path) -> None:
    need, inodes = _needs(bundle, store, versions)
    vfs = os.statvfs(versions)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise BundleError(f"{bundle.path}: needs {need} bytes on {versions}, only {free} free; "
                          "nothing was written (free space, or lower [ota] keep_versions)")
    if vfs.f_files and inodes > vfs.f_favail:  # f_files 0: the file system counts no inodes
        raise BundleError(f"{bundle.path}: needs {inodes} inodes (files) on {versions}, only "
                          f"{vfs.f_favail} free; nothing was written (free some files)")


def _member_kind(m: tarfile.TarInfo) -> str:
    if m.isdir():
        return "directory"
    if m.issym():
        return "symlink"
    if m.islnk():
        return "hard link"
    if m.issparse():
        return "sparse file"
    return "device or special file"


def _checked_member(tar_name: str, m: tarfile.TarInfo, wanted: dict[str, FileEntry],
                    seen: set[str]) -> FileEntry:
    """Refuse anything but a plain file the manifest lists as carried, once, with its size."""
    if not m.isfile() or m.issparse():
        raise BundleError(f"{tar_name}: refusing {_member_kind(m)} entry {shown(m.name)}")
    rel = m.name[len("files/"):] if m.name.startswith("files/") else None
    if rel is None or rel not in wanted:
        raise BundleError(f"{tar_name}: refusing entry {shown(m.name)}: not a file the signed "
                          "manifest lists as carried (path traversal or injected file)")
    if rel in seen:
        raise BundleError(f"{tar_name}: refusing entry {shown(m.name)}: it appears twice")
    entry = wanted[rel]
    if m.size != entry.size:
        raise BundleError(f"{tar_name}: {rel} fails its check: manifest says {entry.size} bytes, "
                          f"the bundle's entry is {m.size} bytes; nothing of it was written")
    return entry


def _copy_bounded(src: IO[bytes], out: IO[bytes] | None, limit: int, fs: Fs | None) -> tuple[int, str]:
    """Copy at most `limit` bytes (one more is read only to prove the member ends there)."""
    h, size = hashlib.sha256(), 0
    while size < limit:
        chunk = src.read(min(CHUNK, limit - size))
        if not chunk:
            break
        h.update(chunk)
        size += len(chunk)
        if out is not None and fs is not None:
            fs.write(out, chunk)
    if size == limit and src.read(1):
        size += 1  # longer than declared: refused by the caller, nothing more written
    return size, h.hexdigest()


def _check(tar_name: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise BundleError(f"{tar_name}: {entry.path} fails its check: manifest says {entry.size} bytes, "
                          f"sha256 {entry.sha256[:16]}…; bundle has {size} bytes, sha256 {digest[:16]}…")


def _extract_one(tar: tarfile.TarFile, m: tarfile.TarInfo, entry: FileEntry, store: Store) -> bool:
    """The member's content into the store (True), or only hashed when the store has it intact
    (False); a damaged object is written anew from the bundle."""
    known = store.intact(entry.sha256, entry.size)
    try:
        with tar.extractfile(m) as src:  # type: ignore[union-attr]
            size, digest = (_copy_bounded(src, None, entry.size, None) if known
                            else store.add(src, entry, _copy_bounded))
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{tar.name}: truncated bundle at {entry.path}: {exc}") from None
    except OSError as exc:
        if exc.errno in FULL:
            raise
        raise BundleError(f"{tar.name}: truncated or unreadable bundle at {entry.path}: {exc}") from None
    _check(str(tar.name), entry, size, digest)
    return not known


def _carried(bundle: Bundle) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo, FileEntry]]:
    """Every member after the manifest, checked against the signed list (each file once, plain,
    of its declared size); a bundle that ends before every carried file is refused."""
    wanted = {f.path: f for f in bundle.files if f.carried}
    seen: set[str] = set()
    try:
        with tarfile.open(bundle.path, "r:") as tar:
            for i, member in enumerate(tar):
                if i < 2:
                    continue  # manifest.json, manifest.sig: already verified
                entry = _checked_member(str(bundle.path), member, wanted, seen)
                yield tar, member, entry
                seen.add(entry.path)
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{bundle.path}: truncated or corrupt bundle: {exc}") from None
    missing = sorted(set(wanted) - seen)
    if missing:
        raise BundleError(f"{bundle.path}: truncated bundle: missing {missing[:3]}")


def extract_files(bundle: Bundle, dest: Path, store: Store, fs: Fs) -> dict[str, Any]:
    """Every file of the version at dest/<path>: carried ones from the bundle through the store,
    the others (thin) from the store or an installed version. What was written and reused."""
    done: dict[str, Any] = {"written_bytes": 0, "reused_bytes": 0, "copied": []}
    for tar, member, entry in _carried(bundle):
        written = _extract_one(tar, member, entry, store)
        done["written_bytes" if written else "reused_bytes"] += entry.size
        _placed(done, entry, store.place(store.object(entry.sha256), dest / entry.path))
    for entry in (f for f in bundle.files if not f.carried):
        done["reused_bytes"] += entry.size
        _placed(done, entry, store.place(store.source(entry), dest / entry.path))
    return done


def refill(bundle: Bundle, store: Store, paths: set[str]) -> None:
    """These carried files of the bundle into the store, written anew where the store's object is
    damaged or gone (each hashed as it is written: one that fails its check is refused)."""
    for tar, member, entry in _carried(bundle):
        if entry.path in paths:
            _extract_one(tar, member, entry, store)


def _placed(done: dict[str, Any], entry: FileEntry, copied_because: str | None) -> None:
    if copied_because is not None:
        done["copied"].append(f"{entry.path} ({copied_because})")


def scan(bundle: Bundle) -> Iterator[tuple[FileEntry, str | None]]:
    """(entry, problem or None) for every manifest file, hashing each member as it streams by
    (a thin bundle's files that it does not carry have no problem here: the device has them)."""
    wanted = {f.path: f for f in bundle.files if f.carried}
    problems: dict[str, str | None] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(bundle.path, "r:") as tar:
            for i, m in enumerate(tar):
                if i < 2:
                    continue
                entry = _checked_member(str(bundle.path), m, wanted, seen)
                seen.add(entry.path)
                with tar.extractfile(m) as src:  # type: ignore[union-attr]
                    size, digest = _copy_bounded(src, None, entry.size, None)
                ok = size == entry.size and digest == entry.sha256
                problems[entry.path] = None if ok else f"{size} bytes, sha256 {digest[:16]}…"
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleError(f"{bundle.path}: truncated or corrupt bundle: {exc}") from None
    for f in bundle.files:
        if not f.carried:
            yield f, None
        else:
            yield f, problems[f.path] if f.path in problems else "missing from the bundle"
