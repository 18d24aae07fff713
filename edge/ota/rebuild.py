"""A state.json that is empty, not JSON or gone (while versions are installed) is rebuilt from
what the disk still says, and the rebuild says what it found and what it assumed:

  current, previous  the `current` and `previous` links;
  committed or not   each version's .complete marker (staged, committed, failed). A `current`
                     link to a version never committed is the PENDING shape (current -> new,
                     previous -> old): it becomes the pending install, which recover rolls back,
                     so an unconfirmed version is never served because the record was lost;
  highest            the highest of state.json.prev's, every committed version and every
                     marker's floor (a rollback of the highest version keeps it: the current
                     version's marker carries it), so it never goes down;
  the last install   state.json.prev's history, then what the markers say happened since: an
                     install pending there and not current now was rolled back, a marker newer
                     than the last event adds its event; without that history, a failed
                     marker says rolled back, and a commit proves nothing (the rollback after it
                     may have pruned its version): `unknown`, never a success;
  the rest           content digests, history, the factory entry and an unfinished repair come
                     from state.json.prev (the state before the last write) where it is readable;
                     the digests of versions it does not name from their installed manifests,
                     only where the manifest's signature verifies with the device's key (a
                     damaged manifest is no record: the version's own bundle then repairs it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.ota.links import FACTORY, read
from edge.ota.manifest import content_digest
from edge.ota.statefile import LEGACY, Marker, StateFile, marker_of, now
from edge.ota.version import highest, parsed

__all__ = ["rebuild_state", "EMPTY"]

EMPTY: dict[str, Any] = {"current": None, "previous": None, "pending": None, "highest": None,
                         "digests": {}, "history": [], "factory": None, "repair": None,
                         "retire": None}
# what an install ended in (or is at): the events a rebuild derives, and what edge_ota_last_result shows
_INSTALL_EVENTS = ("staged", "committed", "rolled back", "rollback unhealthy", "unknown")
_EVENT_OF = {"staged": "staged", "committed": "committed", "failed": "rolled back"}


def _last_install(history: list[Any]) -> dict[str, Any] | None:
    """The last install event of a history (a state rebuild's own note is not one)."""
    return next((e for e in reversed(history) if isinstance(e, dict) and e.get("event") in _INSTALL_EVENTS), None)


def _version(root: Path, link: str) -> str | None:
    target = read(root / link)
    if target is None or target == FACTORY or not target.startswith("versions/"):
        return None
    name = target[len("versions/"):]
    return name if marker_of(root / "versions" / name) else None


def _installed(root: Path) -> dict[str, Marker]:
    """version -> its marker, for every complete version directory."""
    versions = root / "versions"
    found = {d.name: marker_of(d) for d in versions.iterdir()} if versions.is_dir() else {}
    return {v: m for v, m in found.items() if m is not None}


def _same(last: dict[str, Any], version: str, event: str) -> bool:
    if last.get("event") == "rollback unhealthy":  # written after the rollback that marked a version failed
        return event == "rolled back"
    return (last.get("version"), last.get("event")) == (version, event)


def _derived(st: dict[str, Any], prev: dict[str, Any] | None, installed: dict[str, Marker]) -> dict[str, Any]:
    """The install event the disk says came last, where state.json.prev's history does not end in it."""
    last = _last_install(st["history"]) or {}
    pending = (st["pending"] or {}).get("version")
    if last.get("event") == "staged" and last.get("version") != pending:
        v = last["version"]  # pending at the write before the last, and no longer: committed or rolled back
        done = v == st["current"] and installed.get(v, Marker(v, "failed")).state in ("committed", LEGACY)
        return {"version": v, "event": "committed" if done else "rolled back",
                "at": (installed[v].at if v in installed else None) or last.get("at")}
    # markers changed in the same second: a failure first (a rebuild never reports a success it cannot tell)
    timed = sorted((m.at, _EVENT_OF[m.state] == "rolled back", parsed(v) is not None, v, _EVENT_OF[m.state])
                   for v, m in installed.items() if m.at and m.state in _EVENT_OF)
    newest = [t for t in timed if t[0] == timed[-1][0]]
    if newest and not (last and (newest[0][0] < str(last.get("at") or "") or
                                 any(_same(last, t[3], t[4]) for t in newest))):
        at, _, _, v, event = newest[-1]
        # after the write state.json.prev shows, a newer marker is the last write's event; with no
        # history at all, a commit is no proof: the rollback after it may have pruned its version
        if last or event != "committed":
            return {"version": v, "event": event, "at": at}
    if last or not (installed or prev):
        return {}
    return {"version": None, "event": "unknown", "at": None}


def _verified_digest(vdir: Path, pubkey: Path | None) -> str | None:
    """The content digest of a version's own manifest, where its signature verifies it; None
    otherwise (a damaged manifest must never become the record that locks out its own bundle)."""
    if pubkey is None:
        return None
    from edge.ota.bundle import signature_ok

    try:
        raw = (vdir / "manifest.json").read_bytes()
        if not signature_ok(pubkey, (vdir / "manifest.sig").read_bytes(), raw):
            return None
        return content_digest(json.loads(raw))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def rebuild_state(root: Path, problem: str, pubkey: Path | None = None) -> dict[str, Any]:
    prev, _ = StateFile.parse(root / "state.json.prev")
    st: dict[str, Any] = {**json.loads(json.dumps(EMPTY)), **{k: prev[k] for k in EMPTY if prev and k in prev}}
    installed = _installed(root)
    committed = sorted((v for v, m in installed.items() if m.state in ("committed", LEGACY) and parsed(v)),
                       key=lambda v: parsed(v))  # type: ignore[arg-type, return-value]
    cur, prv = _version(root, "current"), _version(root, "previous")
    assumed = []
    if cur is not None and installed[cur].state not in ("committed", LEGACY):
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
    st["highest"] = highest(st.get("highest"), *committed, *(m.highest for m in installed.values()))
    for v in installed:
        digest = _verified_digest(root / "versions" / v, pubkey)
        if digest is not None:
            st["digests"].setdefault(v, digest)  # the record before the disk
    event = _derived(st, prev, installed)
    if event:
        st["history"] = st["history"][-49:] + [{**event, "at": event["at"] or now(), "reason": (
            "derived by the state rebuild from the .complete markers" if event["event"] != "unknown" else
            "the state rebuild found nothing that says how the last install ended")}]
    st["rebuilt"] = (f"{problem}: rebuilt from the links, .complete markers and manifests"
                     f"{' and state.json.prev' if prev else ''}: current {st['current']}, previous "
                     f"{st['previous']}, pending {(st['pending'] or {}).get('version')}, highest "
                     f"{st['highest']}" + (f"; assumed: {'; '.join(assumed)}" if assumed else ""))
    return st
