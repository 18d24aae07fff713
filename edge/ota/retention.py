"""What recover and every commit and rollback clean up: leftovers of killed commands, then
versions beyond `[ota] keep_versions` (current, previous and pending always stay; of the others,
never-committed ones go first, then the lowest by SemVer, not the oldest directory), then the
store's objects no kept version references, and every version's own link put back home.
"""

from __future__ import annotations

from pathlib import Path

from edge.ota import links
from edge.ota.fsops import Fs
from edge.ota.statefile import LEGACY, read_marker
from edge.ota.store import Store
from edge.ota.version import Version, parse_version, parsed

__all__ = ["clean_garbage", "prune", "retire"]


def clean_garbage(root: Path, fs: Fs) -> None:
    """Temp links and files, a half-recorded factory state, staging (and repair) leftovers and
    version dirs without .complete (staged by a killed install, or half-pruned: never linked)."""
    for p in sorted(root.glob(".*.lnk")) + sorted(root.glob(".*.tmp")):
        fs.unlink(p)
    for d in sorted(root.glob(f".{links.FACTORY}-*")):
        fs.rmtree(d)
    for d in sorted((root / "versions").iterdir()):
        if d.name.startswith(".staging-") and not d.is_dir():
            fs.unlink(d)
        elif d.name.startswith(".staging-") or (d.is_dir() and not (d / ".complete").is_file()):
            fs.rmtree(d)


def prune(root: Path, store: Store, fs: Fs, keep: int, protect: set[str]) -> None:
    """Keep `keep` versions, the `protect`ed ones always; then collect the store."""
    versions = root / "versions"
    complete = [d for d in versions.iterdir() if read_marker(d)]
    others = [d for d in complete if d.name not in protect]

    def worth(d: Path) -> tuple[bool, Version]:
        return read_marker(d) in ("committed", LEGACY), parsed(d.name) or parse_version("0.0.0-0")

    for d in sorted(others, key=worth)[:max(0, len(complete) - keep)]:
        retire(d, fs)
    store.collect()
    links.converge(root, fs, [d for d in versions.iterdir() if read_marker(d)]
                   + ([root / links.FACTORY] if (root / links.FACTORY).is_dir() else []))


def retire(vdir: Path, fs: Fs) -> None:
    """A version directory removed: its .complete first, so a kill below leaves garbage (which
    recover deletes), never a half version that looks installed."""
    fs.unlink(vdir / ".complete")
    fs.fsync_dir(vdir)
    fs.rmtree(vdir)
