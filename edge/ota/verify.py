"""`edge ota verify`: every file of every installed version hashed again and compared with the
version's signed manifest (flash bit-rot, a fleet's integrity check), with what else the manifest
says of it (edge.ota.audit: a regular file, mode 0444, the store's object itself). The manifest's own
signature is checked first where the key and manifest.sig (kept since the content store) are
there; a file shared by versions (one object, hard links) is hashed once and named in each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.fsutil import sha256_file
from edge.ota.audit import audit_file
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry, check_path
from edge.ota.statefile import MARKER
from edge.ota.store import Store
from edge.ota.version import VersionError, parse_version

__all__ = ["verify_installed", "signature_note", "file_problem"]


def signature_note(vdir: Path, raw: bytes, pubkey: Path | None) -> str | None:
    """None when the manifest verifies; else why it is not (or was not) checked."""
    if pubkey is None:
        return "manifest signature not checked: no key ([ota] pubkey or --pubkey)"
    sig = vdir / "manifest.sig"
    if not sig.is_file():
        # never clean: an older edge's install, or a deleted signature, reads the same; the
        # version's bundle installed again signs it (edge.ota.recheck writes its manifest.sig)
        return (f"DAMAGED: no manifest.sig: the manifest is unsigned and cannot be checked with {pubkey} "
                f"(install {vdir.name}'s bundle again: it signs the version)")
    from edge.ota.bundle import signature_ok

    return None if signature_ok(pubkey, sig.read_bytes(), raw) else f"DAMAGED: does not verify with {pubkey}"


def file_problem(path: Path, size: int, sha256: str, hashed: dict[tuple[int, int], str]) -> str | None:
    """What is wrong with a file's bytes (None: its size and sha256 are these). `hashed` holds the
    digest of every inode hashed so far: a file shared by versions is read once."""
    try:
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key not in hashed:
            hashed[key] = sha256_file(path)
    except OSError as exc:
        return str(exc.strerror)
    if st.st_size != size or hashed[key] != sha256:
        return (f"{st.st_size} bytes, sha256 {hashed[key][:16]}…; its signed manifest says {size} bytes, "
                f"sha256 {sha256[:16]}…")
    return None


def _order(vdir: Path) -> tuple[int, Any]:
    try:
        return 1, parse_version(vdir.name)
    except VersionError:
        return 0, vdir.name


def _one(vdir: Path, pubkey: Path | None, hashed: dict[tuple[int, int], str]) -> tuple[dict[str, Any], list[str]]:
    name = f"versions/{vdir.name}"
    try:
        raw = (vdir / "manifest.json").read_bytes()
        manifest = json.loads(raw)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"files": 0}, [f"{name}/manifest.json: unreadable ({exc})"]
    note = signature_note(vdir, raw, pubkey)
    bad = [f"{name}/manifest.json: {note[len('DAMAGED: '):]}"] if note and note.startswith("DAMAGED") else []
    try:
        if (vdir / "edge.toml").read_text() != manifest.get("config"):
            bad.append(f"{name}/edge.toml: differs from the config in its signed manifest")
    except (OSError, UnicodeDecodeError) as exc:
        bad.append(f"{name}/edge.toml: unreadable ({exc})")
    store = Store(vdir.parent.parent, Fs())  # read only: objects are looked at, never written
    for f in files:
        try:
            entry = FileEntry(**f)
        except TypeError:
            entry = None
        if entry is None or check_path(entry.path) is not None or not isinstance(entry.size, int):
            bad.append(f"{name}/manifest.json: lists {f.get('path') if isinstance(f, dict) else f!r}, not a file "
                       "entry a version may hold")
            continue
        found = audit_file(vdir, entry, store, hashed)  # type, mode, link to its object, bytes, the object
        if found is not None:
            bad.append(f"{name}/{entry.path}: {found.detail}")
    result: dict[str, Any] = {"files": len(files), "ok": not bad}
    if note and not note.startswith("DAMAGED"):
        result["note"] = note
    return result, bad


def _objects(objects: Path, hashed: dict[tuple[int, int], str]) -> list[str]:
    """The content store's objects whose bytes do not hash to their name (a version's link to one
    was hashed already: read once)."""
    bad = []
    for obj in sorted(objects.iterdir()) if objects.is_dir() else []:
        try:
            size = obj.stat().st_size
        except OSError:
            continue
        if file_problem(obj, size, obj.name, hashed):
            bad.append(f"objects/sha256/{obj.name}: its bytes do not hash to its name (a version's repair "
                       "or a full bundle with this content writes it anew)")
    return bad


def verify_installed(root: Path, pubkey: Path | None) -> dict[str, Any]:
    """{versions: {V: {files, ok, note?}}, problems: [...], hashed_files, result}; problems name
    files; result: ok, damaged, or nothing installed (no complete version to check)."""
    versions = root / "versions"
    dirs = sorted((d for d in versions.iterdir() if (d / MARKER).is_file()), key=_order) if versions.is_dir() else []
    hashed: dict[tuple[int, int], str] = {}
    report: dict[str, Any] = {"versions": {}, "problems": []}
    for vdir in dirs:
        result, bad = _one(vdir, pubkey, hashed)
        report["versions"][vdir.name] = result
        report["problems"] += bad
    report["problems"] += _objects(root / "objects" / "sha256", hashed)
    report["hashed_files"] = len(hashed)
    report["result"] = "damaged" if report["problems"] else "ok" if dirs else "nothing installed"
    return report
