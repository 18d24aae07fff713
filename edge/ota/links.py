"""The `current` and `previous` links, switched without allocating anything, so that a rollback
at boot works on a full file system.

Every installed version (and the factory state) owns one symlink whose target is itself
("versions/V", relative to the OTA root), made while it was staged. While no root link uses it,
it lives at home: versions/V/.link. Pointing `current` at V exchanges V's link with `current`
(renameat2 RENAME_EXCHANGE: one atomic step, no new inode), and the link that was `current`
goes back home into its own version's directory (a rename). A version staged without one, by an
older edge, gets a new symlink: the one case that needs an inode. After a kill, `converge` puts
every link back home.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from edge.ota.fsops import EXCHANGE_UNSUPPORTED, Fs

__all__ = ["HOME", "LINKS", "FACTORY", "read", "point", "converge", "target_of"]

HOME = ".link"
LINKS = ("current", "previous")
FACTORY = "factory"


def target_of(version: str | None) -> str | None:
    return None if version is None else FACTORY if version == FACTORY else f"versions/{version}"


def read(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _home(root: Path, target: str) -> Path | None:
    """Where a link to `target` lives when unused; None for a target edge never makes."""
    name = target[len("versions/"):] if target.startswith("versions/") else None
    if target == FACTORY:
        return root / FACTORY / HOME
    if name and "/" not in name and name not in (".", ".."):
        return root / "versions" / name / HOME
    return None


def _send_home(root: Path, fs: Fs, link: Path, target: str | None) -> None:
    home = _home(root, target) if target else None
    if home is not None and home.parent.is_dir() and not os.path.lexists(home):
        try:
            fs.replace(link, home)
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
    fs.unlink(link)  # its version is gone, has its link already, or is on another file system


def _fresh(root: Path, fs: Fs, name: str, target: str) -> Path:
    tmp = root / f".{name}.{os.getpid()}.lnk"
    if os.path.lexists(tmp):
        fs.unlink(tmp)
    fs.symlink(target, tmp)
    return tmp


def _source(root: Path, fs: Fs, name: str, target: str) -> Path:
    home = _home(root, target)
    if home is not None and read(home) == target:
        return home
    for other in LINKS:
        if other != name and read(root / other) == target:
            return root / other  # `previous` becomes `current` (a rollback), and vice versa
    return _fresh(root, fs, name, target)  # no link to take: a new one (staged by an older edge)


def point(root: Path, fs: Fs, name: str, target: str | None) -> bool:
    """Make root/name point at `target` (None: no link); True when something changed."""
    path = root / name
    now = read(path)
    if now == target and (target is not None or not os.path.lexists(path)):
        return False
    if target is None:
        _send_home(root, fs, path, now)
        return True
    try:
        _switch(root, fs, path, now, _source(root, fs, name, target))
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        fs.replace(_fresh(root, fs, name, target), path)  # versions/ on another file system
    return True


def _switch(root: Path, fs: Fs, path: Path, now: str | None, src: Path) -> None:
    if now is None:
        fs.replace(src, path)
        return
    try:
        fs.exchange(src, path)
    except OSError as exc:
        if exc.errno not in EXCHANGE_UNSUPPORTED:
            raise
        fs.replace(src, path)  # cannot exchange here: the old link is dropped, converge remakes it
        return
    if not (src.parent == root and src.name in LINKS):
        _send_home(root, fs, src, now)


def converge(root: Path, fs: Fs, owners: list[Path]) -> None:
    """Every owner directory's link at home unless a root link uses it (after a kill); a
    missing one is made again where there is room for it."""
    used = {read(root / name) for name in LINKS}
    for d in owners:
        home = d / HOME
        own = f"versions/{d.name}" if d.parent.name == "versions" else FACTORY
        now = read(home)
        if now is not None and now != own:
            _send_home(root, fs, home, now)  # a kill left another version's link here
            now = None
        if now is None and own not in used and not os.path.lexists(home):
            try:
                fs.symlink(own, home)
            except OSError:
                pass  # no room: the next switch to it makes one (docs/ota.md)
