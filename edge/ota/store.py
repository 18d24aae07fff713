"""The content store: every installed file once, by content, at <ota>/objects/sha256/<hex>, and
every version's files hard links to it (OSTree's model: content-addressed objects, versions as
hard-link checkouts, garbage collected by reachability). An unchanged model is then the same
inode in every version, so a reload after a config-only update keeps the loaded model, and
`keep_versions` versions of a 4 GB model cost 4 GB.

Objects are written under objects/tmp/, hashed while written, fsynced and renamed into place
(an object is complete or absent), read-only (MODE, 0444 whatever the umask: the service's user
reads them, nobody writes them): a version's file is the object, not a copy. An object a
version still links (a link count above 1) is never collected, whatever the manifests say. Where
a link is impossible (another file system: EXDEV; a file system without links: EPERM; too many
links: EMLINK) the file is copied and the install says so. A version installed by an edge
before the store (its own copies) is still a source of content: a thin bundle may take a file
from it, after hashing it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from edge.fsutil import sha256_file
from edge.ota.errors import BundleError
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry
from edge.ota.statefile import MARKER

__all__ = ["Store", "MODE", "NO_LINK"]

NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK)
MODE = 0o444  # every object, and so every version's file: readable by all, writable by none
# (source, destination, at most this many bytes, Fs) -> (bytes read, their sha256): extract.py's
CopyFn = Callable[[IO[bytes], IO[bytes], int, Fs], "tuple[int, str]"]


@dataclass
class Store:
    root: Path  # <state_dir>/ota
    fs: Fs
    # objects hashed by this install: an object is trusted by its content, never by its name
    _intact: dict[str, bool] = field(default_factory=dict, repr=False)

    @property
    def objects(self) -> Path:
        return self.root / "objects" / "sha256"

    @property
    def tmp(self) -> Path:
        return self.root / "objects" / "tmp"

    def object(self, sha256: str) -> Path:
        return self.objects / sha256

    def has(self, sha256: str, size: int) -> bool:
        try:
            st = self.object(sha256).stat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def intact(self, sha256: str, size: int) -> bool:
        """The object is there and its bytes hash to its name (once per install: flash bit-rot
        or a damaged object must not be linked into a new version)."""
        if not self.has(sha256, size):
            return False
        if sha256 not in self._intact:
            self._intact[sha256] = sha256_file(self.object(sha256)) == sha256
        return self._intact[sha256]

    def hashed(self) -> dict[tuple[int, int], str]:
        """inode -> sha256 of the objects this command hashed and found intact: a version's link
        to one of them is not read a second time."""
        found = {self.inode(self.object(sha)): sha for sha, ok in self._intact.items() if ok}
        return {ino: sha for ino, sha in found.items() if ino is not None}

    # -- writing -------------------------------------------------------------------------------
    def add(self, src: IO[bytes], entry: FileEntry, copy: CopyFn) -> tuple[int, str]:
        """Stream `src` into a new object; (bytes, sha256) read. The object is renamed into place
        only when both match `entry`: a file that fails its check leaves nothing."""
        self.fs.mkdir(self.tmp)
        self.fs.mkdir(self.objects)
        tmp = self.tmp / f"{entry.sha256}.{os.getpid()}"
        try:
            with self.fs.create(tmp, MODE) as out:
                size, digest = copy(src, out, entry.size, self.fs)
                self.fs.fsync(out)
            if size == entry.size and digest == entry.sha256:  # over a damaged object: repaired
                if stat.S_IMODE(os.stat(tmp).st_mode) != MODE:
                    self.fs.chmod(tmp, MODE)  # a umask took bits off: the service's user must read it
                self.fs.replace(tmp, self.object(entry.sha256))
                self._intact[entry.sha256] = True
        finally:
            if tmp.exists():
                self.fs.unlink(tmp)
        return size, digest

    def place(self, source: Path, dest: Path) -> str | None:
        """A version's file `dest` as a hard link to `source`; a copy where links are
        impossible, with the reason (None when linked)."""
        self.fs.mkdir(dest.parent)
        try:
            self.fs.link(source, dest)
            return None
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            why = os.strerror(exc.errno)
        self.fs.copy(source, dest)
        return why

    # -- finding content -----------------------------------------------------------------------
    def locate(self, entry: FileEntry, avoid: frozenset[tuple[int, int]] = frozenset()) -> Path | None:
        """Where this device has `entry`'s content: its object, or (not yet hashed) a file of an
        installed version whose signed manifest lists the same sha256 and size; never one of the
        inodes in `avoid` (known damaged)."""
        if self.intact(entry.sha256, entry.size):
            return self.object(entry.sha256)
        damaged = avoid | {self.inode(self.object(entry.sha256))}  # versions' links to it are damaged too
        for vdir, manifest in self.manifests():
            for f in manifest.get("files") or []:
                if f.get("sha256") == entry.sha256 and f.get("size") == entry.size:
                    p = vdir / f["path"]
                    try:
                        if p.is_file() and p.stat().st_size == entry.size and self.inode(p) not in damaged:
                            return p
                    except OSError:
                        continue
        return None

    @staticmethod
    def inode(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def source(self, entry: FileEntry, avoid: frozenset[tuple[int, int]] = frozenset()) -> Path:
        """The content for a file a thin bundle does not carry (or a damaged file): an object, or
        an installed version's copy after hashing it (then adopted into the store where links work,
        in place of a damaged object: the repair reaches the store too)."""
        found = self.locate(entry, avoid)
        if found is None:
            raise BundleError(f"{entry.path}: its content (sha256 {entry.sha256[:16]}…) is no longer on "
                              "this device; the installed version is untouched")
        if found.parent == self.objects:
            return found
        digest = sha256_file(found)
        if digest != entry.sha256:
            raise BundleError(f"{entry.path}: the device's copy at {found} is damaged (sha256 {digest[:16]}…, "
                              f"its manifest says {entry.sha256[:16]}…): run `edge ota verify`; a full "
                              "bundle installs anyway")
        return self.adopt(found, entry.sha256) or found

    def adopt(self, found: Path, sha256: str) -> Path | None:
        """An intact file (hashed by the caller) made the store's object for its content, in place
        of a damaged or missing one (a link, then one rename); None where links are impossible."""
        self.fs.mkdir(self.objects)
        obj = self.object(sha256)
        try:
            if os.path.lexists(obj):  # damaged (not intact): replaced, never kept
                self.fs.mkdir(self.tmp)
                tmp = self.tmp / f"{sha256}.{os.getpid()}"
                if os.path.lexists(tmp):
                    self.fs.unlink(tmp)
                self.fs.link(found, tmp)
                self.fs.replace(tmp, obj)
            else:
                self.fs.link(found, obj)
        except OSError as exc:
            if exc.errno not in NO_LINK + (errno.EEXIST,):
                raise
            return None
        self._intact[sha256] = True
        return obj

    def missing(self, files: list[FileEntry]) -> list[FileEntry]:
        """The files of a thin bundle whose content this device does not have."""
        return [f for f in files if not f.carried and self.locate(f) is None]

    # -- reachability --------------------------------------------------------------------------
    def manifests(self) -> list[tuple[Path, dict[str, Any]]]:
        versions = self.root / "versions"
        out = []
        for vdir in sorted(versions.iterdir()) if versions.is_dir() else []:
            if not (vdir / MARKER).is_file():
                continue
            try:
                out.append((vdir, json.loads((vdir / "manifest.json").read_text())))
            except (OSError, ValueError):
                out.append((vdir, {}))
        return out

    def referenced(self) -> set[str] | None:
        """The objects a complete version uses; None when a version's manifest is unreadable
        (then nothing is collected: an object it uses must not go)."""
        used: set[str] = set()
        for _, manifest in self.manifests():
            if not isinstance(manifest.get("files"), list):
                return None
            used.update(f.get("sha256") for f in manifest["files"] if isinstance(f, dict))
        return used

    def collect(self) -> list[str]:
        """Delete the objects no complete version references (and leftovers of killed writes); never
        one a version links (a damaged manifest names another sha256, the file is still served)."""
        for p in sorted(self.tmp.iterdir()) if self.tmp.is_dir() else []:
            self.fs.unlink(p)
        used = self.referenced()
        if used is None or not self.objects.is_dir():
            return []
        gone = sorted(p.name for p in self.objects.iterdir() if p.name not in used and _links(p) <= 1)
        for name in gone:
            self.fs.unlink(self.object(name))
        return gone

    def usage(self) -> dict[str, int]:
        files = list(self.objects.iterdir()) if self.objects.is_dir() else []
        return {"objects": len(files), "bytes": sum(p.stat().st_size for p in files)}



def _links(path: Path) -> int:
    try:
        return os.lstat(path).st_nlink
    except OSError:
        return 0
