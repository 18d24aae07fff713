"""What is wrong with an installed version's files, against what its signed manifest says: each
file's type (a regular file of its own, not a symlink, however right the bytes behind it), mode
(the store's MODE, 0444), link (the store's object itself, where links work: one inode, so a
repair of one is a repair of the other), bytes, and the store's object of its content.

Bytes are checked in full (sha256; a file shared by versions, one inode, hashed once), or, at
boot, as a boot can afford (`sampled`): the size, and a sampled hash against the one written
beside the version when it was staged (`.sampled`: up to WINDOWS windows of WINDOW bytes, spread
over the file; a file up to WINDOWS x WINDOW bytes whole). A file the sampled record does not
name is hashed in full. Reads only: edge.ota.recheck repairs what this finds.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edge.fsutil import sha256_file
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry
from edge.ota.store import MODE, Store

__all__ = ["BYTES", "Finding", "SAMPLED", "audit_file", "read_sampled", "sampled_digest", "write_sampled"]

SAMPLED = ".sampled"  # versions/V/.sampled: {"window", "windows", "files": {path: sampled digest}}
WINDOW, WINDOWS = 64 << 10, 16
BYTES = ("missing", "type", "content")  # what makes a file's bytes untrustworthy: it is replaced


@dataclass(frozen=True)
class Finding:
    """One file's problems: kinds (missing, type, content, mode, link, object) and what was seen."""

    entry: FileEntry
    kinds: tuple[str, ...]
    detail: str

    @property
    def bytes_bad(self) -> bool:
        return any(k in BYTES for k in self.kinds)


def sampled_digest(path: Path, size: int) -> str:
    """sha256 of the size and the sampled windows (the whole file when it is small)."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= WINDOW * WINDOWS:
            h.update(f.read())
        else:
            for i in range(WINDOWS):
                f.seek((size - WINDOW) * i // (WINDOWS - 1))
                h.update(f.read(WINDOW))
    return h.hexdigest()


def write_sampled(fs: Fs, vdir: Path, files: Iterable[FileEntry], atomic: bool = False) -> None:
    """The sampled hashes of a version's files (checked in full just now), beside them."""
    data = json.dumps({"window": WINDOW, "windows": WINDOWS, "files": {
        f.path: sampled_digest(vdir / f.path, f.size) for f in files}}, sort_keys=True).encode()
    (fs.atomic_write if atomic else fs.write_file)(vdir / SAMPLED, data)


def read_sampled(vdir: Path) -> dict[str, str]:
    """path -> sampled digest, where the record is there and of this layout; else {} (every file
    is then hashed in full: a hint, never an authority)."""
    try:
        data = json.loads((vdir / SAMPLED).read_text())
        ok = data.get("window") == WINDOW and data.get("windows") == WINDOWS and isinstance(data.get("files"), dict)
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in data["files"].items()} if ok else {}


def _full(path: Path, key: tuple[int, int], hashed: dict[tuple[int, int], str]) -> str:
    if key not in hashed:
        hashed[key] = sha256_file(path)
    return hashed[key]


def audit_file(vdir: Path, entry: FileEntry, store: Store, hashed: dict[tuple[int, int], str],
               sampled: dict[str, str] | None = None) -> Finding | None:
    """The file's problems, None when it is what the manifest says. `hashed`: inode -> sha256 of
    every file hashed so far (read once); `sampled`: check bytes by sample where it names the file."""
    path = vdir / entry.path
    try:
        st = os.lstat(path)
    except OSError as exc:
        return Finding(entry, ("missing",), str(exc.strerror))
    if stat.S_ISLNK(st.st_mode):
        return Finding(entry, ("type",), f"a symlink to {os.readlink(path)!r}, not a file of its own")
    if not stat.S_ISREG(st.st_mode):
        return Finding(entry, ("type",), "not a regular file")
    kinds, said = [], []
    key = (st.st_dev, st.st_ino)
    try:
        if st.st_size != entry.size:
            kinds.append("content")
            said.append(f"{st.st_size} bytes; its signed manifest says {entry.size}")
        elif sampled is not None and entry.path in sampled and key not in hashed:
            if sampled_digest(path, st.st_size) != sampled[entry.path]:
                kinds.append("content")
                said.append("its sampled bytes differ from those it was installed with")
        elif _full(path, key, hashed) != entry.sha256:
            kinds.append("content")
            said.append(f"{st.st_size} bytes, sha256 {hashed[key][:16]}…; its signed manifest says {entry.size} "
                        f"bytes, sha256 {entry.sha256[:16]}…")
    except OSError as exc:  # mode 0000 for a reader without CAP_DAC_OVERRIDE
        kinds.append("content")
        said.append(f"unreadable ({exc.strerror})")
    if stat.S_IMODE(st.st_mode) != MODE:
        kinds.append("mode")
        said.append(f"mode {stat.S_IMODE(st.st_mode):04o}, not {MODE:04o}")
    kinds, said = _object(store, entry, st, hashed, sampled is None, kinds, said)
    return Finding(entry, tuple(kinds), "; ".join(said)) if kinds else None


def _object(store: Store, entry: FileEntry, st: os.stat_result, hashed: dict[tuple[int, int], str], full: bool,
            kinds: list[str], said: list[str]) -> tuple[list[str], list[str]]:
    """The store's object of the file's content: there, the file itself where links work, intact."""
    obj = store.object(entry.sha256)
    try:
        ost = os.lstat(obj)
    except OSError:
        return kinds + ["object"], said + ["its store object is missing"]
    same = (ost.st_dev, ost.st_ino) == (st.st_dev, st.st_ino)
    if not same and ost.st_dev == st.st_dev:
        kinds, said = kinds + ["link"], said + ["a copy, not a link to its store object"]
    if same or not full:
        return kinds, said  # the file's own check is the object's
    try:
        intact = stat.S_ISREG(ost.st_mode) and ost.st_size == entry.size and \
            _full(obj, (ost.st_dev, ost.st_ino), hashed) == entry.sha256
    except OSError:
        intact = False
    return (kinds, said) if intact else (kinds + ["object"], said + ["its store object is damaged"])
