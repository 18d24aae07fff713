"""Bounded extraction: never more bytes than the signed manifest declares, per member and in
total; free space is checked before the first byte is written. `scan` hashes members streaming
(for `edge ota inspect`) without holding a member in memory.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from edge.ota.bundle import Bundle, FileEntry
from edge.ota.errors import BundleError
from edge.ota.fsops import Fs

__all__ = ["check_free_space", "extract_files", "scan", "HEADROOM"]

CHUNK = 1 << 20
HEADROOM = 1 << 20  # edge.toml, manifest.json, markers and directory blocks


def check_free_space(bundle: Bundle, dest: Path) -> None:
    need, free = bundle.total_size + HEADROOM, shutil.disk_usage(dest).free
    if need > free:
        raise BundleError(f"{bundle.path}: needs {need} bytes on {dest}, only {free} free; "
                          "nothing was written (free space, or lower [ota] keep_versions)")


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
    """Refuse anything but a plain file the manifest lists, once, with the size it declares."""
    if not m.isfile() or m.issparse():
        raise BundleError(f"{tar_name}: refusing {_member_kind(m)} entry {m.name!r}")
    rel = m.name[len("files/"):] if m.name.startswith("files/") else None
    if rel is None or rel.startswith("/") or ".." in Path(rel).parts or rel not in wanted:
        raise BundleError(f"{tar_name}: refusing entry {m.name!r}: not a file the signed "
                          "manifest lists (path traversal or injected file)")
    if rel in seen:
        raise BundleError(f"{tar_name}: refusing entry {m.name!r}: it appears twice")
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


def _extract_one(tar: tarfile.TarFile, m: tarfile.TarInfo, entry: FileEntry, dest: Path, fs: Fs) -> None:
    rel, target = entry.path, dest / entry.path
    fs.mkdir(target.parent)
    try:
        with tar.extractfile(m) as src, fs.create(target) as out:  # type: ignore[union-attr]
            size, digest = _copy_bounded(src, out, entry.size, fs)
            fs.fsync(out)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise BundleError(f"disk full while extracting {rel} ({entry.size} bytes, "
                              f"{shutil.disk_usage(dest).free} free on {dest.parent}); "
                              "the installed version is untouched") from None
        raise BundleError(f"{tar.name}: truncated or unreadable bundle at {rel}: {exc}") from None
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{tar.name}: truncated bundle at {rel}: {exc}") from None
    if size != entry.size or digest != entry.sha256:
        raise BundleError(f"{tar.name}: {rel} fails its check: manifest says {entry.size} bytes, "
                          f"sha256 {entry.sha256[:16]}…; bundle has {size} bytes, sha256 {digest[:16]}…")


def extract_files(bundle: Bundle, dest: Path, fs: Fs) -> None:
    wanted = {f.path: f for f in bundle.files}
    seen: set[str] = set()
    try:
        with tarfile.open(bundle.path, "r:") as tar:
            for i, member in enumerate(tar):
                if i < 2:
                    continue  # manifest.json, manifest.sig: already verified
                entry = _checked_member(str(bundle.path), member, wanted, seen)
                _extract_one(tar, member, entry, dest, fs)
                seen.add(entry.path)
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{bundle.path}: truncated or corrupt bundle: {exc}") from None
    missing = sorted(set(wanted) - seen)
    if missing:
        raise BundleError(f"{bundle.path}: truncated bundle: missing {missing[:3]}")


def scan(bundle: Bundle) -> Iterator[tuple[FileEntry, str | None]]:
    """(entry, problem or None) for every manifest file, hashing each member as it streams by."""
    wanted = {f.path: f for f in bundle.files}
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
        yield f, problems[f.path] if f.path in problems else "missing from the bundle"
