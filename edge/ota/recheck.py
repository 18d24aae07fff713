"""Before a version becomes current again (the install of a version already on disk, a rollback,
the version `recover` goes back to), its files are checked against its signed manifest: every
file hashed in full (sha256), a file shared by versions (one inode) once. Flash bit-rot changes
neither a file's size nor its mtime, so no cheaper check sees it; the cost is one read of the
version's bytes (docs/ota.md gives the seconds for the 253 MB Gemma).

A damaged file is rewritten from an intact copy of its content: the store's object, another
version's copy (hashed first), or the bundle being installed (a full bundle carries every file,
written into the store anew); the version's file is then replaced by a link to it in one atomic
rename, and the version's edge.toml by the config of its signed manifest. With a bundle, the
version's manifest.json and manifest.sig are rewritten from it unless they are a signed pair of
the same content: the on-disk manifest is data to check, never an authority. Where no intact copy
exists, the switch is refused, naming the file; the OTA state is not changed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from edge.ota.bundle import Bundle, signature_ok
from edge.ota.errors import BundleError
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry, check_files, content_digest
from edge.ota.store import Store
from edge.ota.verify import file_problem, signature_note

__all__ = ["recheck", "refuse_tampered"]

REPAIR = ".staging-repair"  # versions/.staging-repair-PID: garbage that recover deletes after a kill


def _signed(vdir: Path, pubkey: Path | None) -> tuple[list[FileEntry], str, str]:
    """(files, config, what was checked of the signature) of an installed version's own manifest."""
    name = f"versions/{vdir.name}/manifest.json"
    try:
        raw = (vdir / "manifest.json").read_bytes()
        manifest = json.loads(raw)
        check_files(name, manifest)
        files, config = [FileEntry(**f) for f in manifest["files"]], manifest["config"]
        if not isinstance(config, str):
            raise ValueError("its config is not text")
    except (OSError, ValueError, KeyError, TypeError, BundleError) as exc:
        raise BundleError(f"{name} is unreadable ({exc}): the switch to {vdir.name} is refused; the OTA "
                          "state is unchanged") from None
    note = signature_note(vdir, raw, pubkey)
    if note and note.startswith("DAMAGED"):
        raise BundleError(f"{name}: {note[len('DAMAGED: '):]}: the switch to {vdir.name} is refused; the "
                          "OTA state is unchanged")
    return files, config, note or f"verified with {pubkey}"


def recheck(vdir: Path, store: Store, fs: Fs, *, pubkey: Path | None = None,
            bundle: Bundle | None = None) -> dict[str, Any]:
    """Check (and repair) the version at `vdir` against the bundle's manifest (verified when it was
    opened) or its own; what was checked: files, bytes, seconds, signature, repaired."""
    t0 = time.monotonic()
    if bundle is not None:
        files, config = bundle.files, bundle.manifest["config"]
        note = f"the bundle's, verified with {bundle.signed_by}" if bundle.signed_by else "not checked (--insecure)"
    else:
        files, config, note = _signed(vdir, pubkey)
    hashed = store.hashed()  # objects this command hashed already (a thin bundle's content check)
    damaged = [(f, why) for f in files if (why := file_problem(vdir / f.path, f.size, f.sha256, hashed))]
    repaired = [_repair(vdir, f, why, store, fs, bundle) for f, why in damaged]
    try:
        toml_ok = (vdir / "edge.toml").read_text() == config
    except (OSError, UnicodeDecodeError):
        toml_ok = False
    if not toml_ok:
        fs.atomic_write(vdir / "edge.toml", config.encode())
        repaired.append("edge.toml (from the config of its signed manifest)")
    if bundle is not None and not _manifest_ok(vdir, bundle):
        fs.atomic_write(vdir / "manifest.json", bundle.raw_manifest)
        fs.atomic_write(vdir / "manifest.sig", bundle.signature)
        repaired.append("manifest.json and manifest.sig (from the bundle: its signed manifest)")
    sizes = {f.sha256: f.size for f in files}
    return {"files": len(files), "bytes": sum(sizes.values()), "seconds": round(time.monotonic() - t0, 3),
            "signature": note, **({"repaired": repaired} if repaired else {})}


def refuse_tampered(bundle: Bundle) -> None:
    """A bundle of the installed version: its own bytes hashed against its signed manifest first,
    so that a tampered copy is refused as it would be on any other device."""
    from edge.ota.extract import scan

    bad = [f"{f.path} ({problem})" for f, problem in scan(bundle) if problem]
    if bad:
        raise BundleError(f"{bundle.path}: {len(bad)} file(s) fail their check: {'; '.join(bad)} "
                          f"(version {bundle.version} is installed and stays)")


def _manifest_ok(vdir: Path, bundle: Bundle) -> bool:
    """The version's own manifest.json and manifest.sig are a signed pair of the bundle's content
    (the bundle's bytes, or another build of the same content verified by the same key). Data to
    check, never an authority: a pair that is not is rewritten from the bundle."""
    try:
        raw, sig = (vdir / "manifest.json").read_bytes(), (vdir / "manifest.sig").read_bytes()
    except OSError:
        return False
    if (raw, sig) == (bundle.raw_manifest, bundle.signature):
        return True
    try:
        manifest = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(manifest, dict) or content_digest(manifest) != bundle.content_digest:
        return False
    return bundle.signed_by is not None and signature_ok(Path(bundle.signed_by), sig, raw)


def _repair(vdir: Path, entry: FileEntry, why: str, store: Store, fs: Fs, bundle: Bundle | None) -> str:
    """Replace the damaged file by a link to an intact copy of its content; what was done."""
    target = vdir / entry.path
    shown = f"versions/{vdir.name}/{entry.path}"
    bad = store.inode(target)
    try:
        source, whence = store.source(entry, frozenset({bad} if bad else ())), "an intact copy on this device"
    except BundleError:
        if bundle is None or not entry.carried:
            raise BundleError(f"{shown} is damaged ({why}) and this device has no intact copy of its content: "
                              f"the switch to {vdir.name} is refused; the OTA state is unchanged (install "
                              f"{vdir.name}'s full bundle again: it rewrites the file)") from None
        from edge.ota.extract import refill

        refill(bundle, store, {entry.path})
        source, whence = store.object(entry.sha256), str(bundle.path)
    tmp = vdir.parent / f"{REPAIR}-{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            fs.unlink(tmp)
        copied = store.place(source, tmp)
        fs.mkdir(target.parent)
        fs.replace(tmp, target)
        fs.fsync_dir(target.parent)
    except OSError as exc:
        fs.unlink(tmp)
        raise BundleError(f"{shown} is damaged ({why}) and could not be rewritten ({exc.strerror}): the "
                          f"switch to {vdir.name} is refused; the OTA state is unchanged") from None
    return f"{entry.path} (was {why}; rewritten from {whence}{f', copied: {copied}' if copied else ''})"
