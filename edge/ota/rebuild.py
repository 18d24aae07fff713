"""A state.json that is empty, not JSON or gone (while versions are installed) is rebuilt from
what the disk still says, and the rebuild says what it found and what it assumed:

  current, previous  the `current` and `previous` links;
  committed or not   each version's .complete marker (staged, committed, failed). A `current`
                     link to a version never committed is the PENDING shape (current -> new,
                     previous -> old): it becomes the pending install, which recover rolls back,
                     so an unconfirmed version is never served because the record was lost;
  the rest           highest, content digests, history and the factory entry come from
                     state.json.prev (the state before the last write) where it is readable,
                     and the digests and `highest` also from every installed manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.ota.links import FACTORY, read
from edge.ota.manifest import content_digest
from edge.ota.statefile import LEGACY, StateFile, read_marker
from edge.ota.version import Version, VersionError, parse_version

__all__ = ["rebuild_state", "EMPTY"]

EMPTY: dict[str, Any] = {"current": None, "previous": None, "pending": None, "highest": None,
                         "digests": {}, "history": [], "factory": None}


def _version(root: Path, link: str) -> str | None:
    target = read(root / link)
    if target is None or target == FACTORY or not target.startswith("versions/"):
        return None
    name = target[len("versions/"):]
    return name if read_marker(root / "versions" / name) else None


def _parsed(text: str | None) -> Version | None:
    try:
        return parse_version(text)
    except VersionError:
        return None


def _installed(root: Path) -> dict[str, str]:
    """version -> its marker's state, for every complete version directory."""
    versions = root / "versions"
    found = {d.name: read_marker(d) for d in versions.iterdir()} if versions.is_dir() else {}
    return {v: s for v, s in found.items() if s is not None}


def rebuild_state(root: Path, problem: str) -> dict[str, Any]:
    prev, _ = StateFile.parse(root / "state.json.prev")
    st: dict[str, Any] = {**json.loads(json.dumps(EMPTY)), **{k: prev[k] for k in EMPTY if prev and k in prev}}
    installed = _installed(root)
    committed = sorted((v for v, s in installed.items() if s in ("committed", LEGACY) and _parsed(v)),
                       key=lambda v: _parsed(v))  # type: ignore[arg-type, return-value]
    cur, prv = _version(root, "current"), _version(root, "previous")
    assumed = []
    if cur is not None and installed[cur] not in ("committed", LEGACY):
        st.update(current=prv, pending={"version": cur, "previous": (prev or {}).get("previous")})
        st["previous"] = st["pending"]["previous"] if st["pending"]["previous"] in installed else None
        assumed.append(f"{cur} was never committed: pending (recover rolls it back)")
    elif cur is not None:
        st.update(current=cur, previous=prv, pending=None)
    else:
        st.update(current=committed[-1] if committed else None, pending=None,
                  previous=committed[-2] if len(committed) > 1 else None)
        if committed:
            assumed.append(f"no `current` link: the highest committed version, {committed[-1]}")
    floor = [p for p in (_parsed(st.get("highest")), *(_parsed(v) for v in committed)) if p is not None]
    st["highest"] = str(max(floor)) if floor else None
    for v in installed:
        try:
            st["digests"][v] = content_digest(json.loads((root / "versions" / v / "manifest.json").read_text()))
        except (OSError, ValueError):
            pass
    st["rebuilt"] = (f"{problem}: rebuilt from the links, .complete markers and manifests"
                     f"{' and state.json.prev' if prev else ''}: current {st['current']}, previous "
                     f"{st['previous']}, pending {(st['pending'] or {}).get('version')}, highest "
                     f"{st['highest']}" + (f"; assumed: {'; '.join(assumed)}" if assumed else ""))
    return st
