"""The OTA's durable records, written so that they need no new inode and no new block at the
moment they matter (a commit, a rollback, a boot-time recover on a full file system):

state.json and state.json.prev are two slots of SLOT bytes each, made while there is room (the
start of every install). A write fills the spare slot in place (JSON, then blank padding:
JSON allows trailing white space), fsyncs it and exchanges the two names in one atomic step
(renameat2 RENAME_EXCHANGE): state.json is the new state, state.json.prev the one before it,
which is what a damaged state.json is rebuilt from (edge.ota.rebuild).

versions/<V>/.complete, the marker that makes a version directory installed, holds the version,
what became of it (staged, committed, failed), when that happened, and the highest version ever
committed on the device as known at that moment; it is overwritten in place on the same
MARKER_SIZE bytes. Pruning prefers never-committed versions; a rebuild knows which versions were
committed, which install happened last, and the anti-downgrade floor even when both state slots
are lost (every switch rewrites the current version's marker, and the current version is never
pruned).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.ota.errors import BundleError
from edge.ota.fsops import EXCHANGE_UNSUPPORTED, Fs
from edge.ota.version import highest

__all__ = ["StateFile", "SLOT", "MARKER", "MARKER_SIZE", "Marker", "now", "read_marker", "marker_of",
           "write_marker", "overwrite_marker"]

SLOT = 128 << 10  # > 50 history entries of 600-character reasons + 200 content digests
MARKER = ".complete"
MARKER_SIZE = 256  # version, state, time and highest: 4 lines of at most 64, 9, 20 and 64 characters
STATES = ("staged", "committed", "failed")
LEGACY = "committed?"  # a marker written before markers said more than the version


def _padded(text: str, size: int) -> bytes:
    data = text.encode()
    if len(data) + 1 > size:
        raise ValueError(f"{len(data)} bytes do not fit in a slot of {size}")
    return data + b" " * (size - len(data) - 1) + b"\n"


class StateFile:
    def __init__(self, root: Path, fs: Fs) -> None:
        self.path, self.spare, self.fs = root / "state.json", root / "state.json.prev", fs

    @staticmethod
    def parse(path: Path) -> tuple[dict[str, Any] | None, str | None]:
        """(state, None), (None, None) when absent, or (None, what is wrong with it)."""
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return None, None
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"{path.name} is unreadable ({exc})"
        if not text.strip():
            return None, f"{path.name} is empty"
        try:
            st = json.loads(text)
        except ValueError as exc:
            return None, f"{path.name} is not JSON ({exc})"
        if not isinstance(st, dict):
            return None, f"{path.name} is not a JSON object"
        return st, None

    def ensure_slots(self) -> None:
        """Both slots at full size, made while there is room so that later writes need none. A
        failure (a full file system) is no error yet: write() says so if it needs the slot."""
        st, problem = self.parse(self.path)
        for p in (self.path, self.spare):
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                size = -1
            if size >= SLOT or (p == self.path and problem):
                continue  # a damaged state.json is rebuilt and then written into the spare
            own = self.parse(p)[0] if size >= 0 else None
            data = _padded(json.dumps(own or st or {}, indent=2), SLOT)
            try:
                if p == self.spare and size >= 0:
                    self.fs.overwrite(p, data)
                else:  # made, or an older edge's short state.json grown once: atomically
                    self.fs.atomic_write(p, data)
            except OSError:
                return

    def write(self, st: dict[str, Any]) -> None:
        """The new state; an OSError (a full file system before the slots existed) propagates,
        and the command's lock turns it into one line naming the file (edge.ota.install)."""
        data = _fit(st)
        if not self.spare.exists() or self.spare.stat().st_size < SLOT:
            self.ensure_slots()
        self.fs.overwrite(self.spare, data)
        self._exchange()
        self.fs.fsync_dir(self.path.parent)

    def _exchange(self) -> None:
        if not self.path.exists():
            self.fs.replace(self.spare, self.path)  # ensure_slots could not make it: no room
            return
        try:
            self.fs.exchange(self.spare, self.path)
        except OSError as exc:
            if exc.errno not in EXCHANGE_UNSUPPORTED:
                raise
            # a file system that cannot exchange names: the old state is kept by a copy, then the
            # rename (both need room; docs/ota.md says where exchange works)
            old = self.path.read_bytes()
            self.fs.replace(self.spare, self.path)
            self.fs.atomic_write(self.spare, old)


def _fit(st: dict[str, Any]) -> bytes:
    """The state as one slot's bytes; the oldest history goes first if it would not fit."""
    st = dict(st)
    while True:
        text = json.dumps(st, indent=2)
        if len(text.encode()) < SLOT:
            return _padded(text, SLOT)
        if st.get("history"):
            st["history"] = st["history"][1:]
        elif st.get("digests"):
            st["digests"] = dict(list(st["digests"].items())[1:])
        else:
            raise BundleError(f"the OTA state does not fit in {SLOT} bytes")


def now() -> str:
    """The time of an OTA event, as history and markers write it (UTC, to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Marker:
    version: str
    state: str  # staged | committed | failed | LEGACY
    at: str | None = None  # when it entered that state (markers of an older edge have none)
    highest: str | None = None  # the highest version committed on the device, as known then

    def text(self, short: bool = False) -> str:
        return f"{self.version}\n{self.state}" if short else \
            f"{self.version}\n{self.state}\n{self.at or ''}\n{self.highest or ''}"


def marker_of(version_dir: Path) -> Marker | None:
    """The version directory's marker; None when it is not a complete version."""
    try:
        lines = [line.strip() for line in (version_dir / MARKER).read_text().split("\n")]
    except (OSError, UnicodeDecodeError):
        return None
    lines += [""] * (4 - len(lines))
    state = lines[1] if lines[1] in STATES else LEGACY
    return Marker(lines[0], state, lines[2] or None, lines[3] or None)


def read_marker(version_dir: Path) -> str | None:
    """What became of an installed version: staged, committed, failed (or LEGACY); None when
    the directory is not a complete version."""
    m = marker_of(version_dir)
    return None if m is None else m.state


def write_marker(fs: Fs, version_dir: Path, version: str, floor: str | None) -> None:
    """The marker of a version being staged (a new file, while the stage has room)."""
    with fs.create(version_dir / MARKER) as f:
        fs.write(f, _padded(Marker(version, "staged", now(), floor).text(), MARKER_SIZE))
        fs.fsync(f)


def overwrite_marker(fs: Fs, version_dir: Path, version: str, state: str, floor: str | None) -> None:
    """A version's marker says `state` from now on, and a floor at least `floor`; in place, so it
    needs no room, and only when that changes it. A marker too short for the time and floor (one
    of an older edge) keeps the state alone; one too short even for that stays: it reads as
    committed."""
    marker = version_dir / MARKER
    old = marker_of(version_dir)
    try:
        size = marker.stat().st_size
    except OSError:
        return
    if old is None:
        return
    new = Marker(version, state, old.at if state == old.state else now(), highest(old.highest, floor))
    if new == old:
        return
    for text in (new.text(), new.text(short=True)):
        if len(text.encode()) + 1 <= size:
            return fs.overwrite(marker, _padded(text, size))
