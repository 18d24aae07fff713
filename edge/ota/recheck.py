"""Before a version becomes current again (the install of a version already on disk, a rollback,
the version `recover` goes back to), and whenever the current one is checked (its own bundle
pushed again, a boot), its files are checked against its signed manifest (edge.ota.audit: type,
mode, link to the store's object, bytes, the object itself): every file hashed in full, a file
shared by versions (one inode) once; at boot, as a boot can afford. Flash bit-rot changes neither
a file's size nor its mtime, so no cheaper check sees it in full; the cost is one read of the
version's bytes (docs/ota.md gives the seconds for the 253 MB Gemma).

`inspect` finds (reads only); `repair` mends, each fix one atomic step: a file whose bytes are
wrong or that is no file of its own becomes a link to an intact copy of its content (the store's
object, another version's copy, hashed first, or the bundle being installed, written into the
store anew) by one rename; a copy becomes the store's object again (or the object is made from
it, where the object is damaged or gone); a wrong mode is set again (chmod: in place); edge.toml
is rewritten from the signed manifest's config; with a bundle, manifest.json and manifest.sig
from the bundle unless they are a signed pair of the same content (an --insecure bundle never
replaces a signature that verifies). Where no intact copy exists, the repair is refused naming
the file. A full file system is the caller's OSError (exit 75), never a refusal.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from edge.fsutil import sha256_file
from edge.ota.audit import SAMPLED, Finding, audit_file, read_sampled, write_sampled
from edge.ota.bundle import Bundle, signature_ok
from edge.ota.errors import BundleError
from edge.ota.fsops import Fs
from edge.ota.manifest import FileEntry, check_files, content_digest
from edge.ota.store import MODE, Store
from edge.ota.verify import signature_note

__all__ = ["Inspection", "inspect", "recheck", "refuse_tampered", "remember_sampled", "repair", "summary"]

REPAIR = ".staging-repair"  # versions/.staging-repair-PID: garbage that recover deletes after a kill
FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Inspection:
    """What `inspect` found of one version: its files and config (from the bundle or its own
    signed manifest), what verified them, and what is wrong."""

    vdir: Path
    files: list[FileEntry]
    config: str
    signature: str
    findings: list[Finding] = field(default_factory=list)
    toml_ok: bool = True
    manifest_ok: bool = True  # with a bundle: its own manifest.json and manifest.sig are a signed pair of it
    seconds: float = 0.0

    @property
    def damaged(self) -> bool:
        return bool(self.findings) or not self.toml_ok or not self.manifest_ok

    @property
    def served_changed(self) -> bool:
        """A repair changes what the service reads: a file's bytes, or edge.toml."""
        return any(f.bytes_bad for f in self.findings) or not self.toml_ok

    def said(self) -> list[str]:
        return ([f"{f.entry.path} ({f.detail})" for f in self.findings] + ([] if self.toml_ok else ["edge.toml"])
                + ([] if self.manifest_ok else ["manifest.json and manifest.sig"]))


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


def inspect(vdir: Path, store: Store, *, pubkey: Path | None = None, bundle: Bundle | None = None,
            sampled: bool = False, device_key: Path | None = None) -> Inspection:
    """Check the version at `vdir` against the bundle's manifest (verified when it was opened) or
    its own (BundleError where that is unreadable or does not verify). `device_key`: the device's
    key, which an --insecure bundle's manifest pair is judged by."""
    t0 = time.monotonic()
    if bundle is not None:
        files, config = bundle.files, bundle.manifest["config"]
        note = f"the bundle's, verified with {bundle.signed_by}" if bundle.signed_by else "not checked (--insecure)"
    else:
        files, config, note = _signed(vdir, pubkey)
    hashed = store.hashed()  # objects this command hashed already (a thin bundle's content check)
    marks = read_sampled(vdir) if sampled else None
    found = [f for entry in files if (f := audit_file(vdir, entry, store, hashed, marks)) is not None]
    try:
        toml_ok = (vdir / "edge.toml").read_text() == config
    except (OSError, UnicodeDecodeError):
        toml_ok = False
    pair = bundle is None or _manifest_ok(vdir, bundle, device_key)
    return Inspection(vdir, files, config, note, found, toml_ok, pair, time.monotonic() - t0)


def repair(insp: Inspection, store: Store, fs: Fs, bundle: Bundle | None = None,
           device_key: Path | None = None) -> list[str]:
    """Mend what `inspect` found; what was done (one line a fix)."""
    vdir = insp.vdir
    done = [_fix(vdir, f, store, fs, bundle) for f in insp.findings]
    if not insp.toml_ok:
        fs.atomic_write(vdir / "edge.toml", insp.config.encode())
        done.append("edge.toml (from the config of its signed manifest)")
    if not insp.manifest_ok and bundle is not None:
        fs.atomic_write(vdir / "manifest.json", bundle.raw_manifest)
        if not _keeps_signature(vdir, bundle, device_key):
            fs.atomic_write(vdir / "manifest.sig", bundle.signature)
        done.append("manifest.json and manifest.sig (from the bundle: its signed manifest)")
    if done:  # the sampled record of what is now checked in full, for the next boot
        remember_sampled(fs, vdir, insp.files)
    return done


def remember_sampled(fs: Fs, vdir: Path, files: list[FileEntry]) -> None:
    """The sampled record of a version just checked in full; best effort (a boot without it
    hashes in full), so a file system that is full now fails nothing here."""
    try:
        write_sampled(fs, vdir, files, atomic=True)
    except OSError:
        for tmp in vdir.glob(".{SAMPLED}.*.tmp".replace("{SAMPLED}", SAMPLED)):
            tmp.unlink(missing_ok=True)


def recheck(vdir: Path, store: Store, fs: Fs, *, pubkey: Path | None = None,
            bundle: Bundle | None = None) -> dict[str, Any]:
    """Check (and repair) the version at `vdir`; what was checked: files, bytes, seconds,
    signature, repaired."""
    insp = inspect(vdir, store, pubkey=pubkey, bundle=bundle, device_key=pubkey)
    repaired = repair(insp, store, fs, bundle, pubkey)
    return summary(insp, repaired)


def summary(insp: Inspection, repaired: list[str]) -> dict[str, Any]:
    sizes = {f.sha256: f.size for f in insp.files}
    return {"files": len(insp.files), "bytes": sum(sizes.values()), "seconds": round(insp.seconds, 3),
            "signature": insp.signature, **({"repaired": repaired} if repaired else {})}


def refuse_tampered(bundle: Bundle) -> None:
    """A bundle of the installed version: its own bytes hashed against its signed manifest first,
    so that a tampered copy is refused as it would be on any other device."""
    from edge.ota.extract import scan

    bad = [f"{f.path} ({problem})" for f, problem in scan(bundle) if problem]
    if bad:
        raise BundleError(f"{bundle.path}: {len(bad)} file(s) fail their check: {'; '.join(bad)} "
                          f"(version {bundle.version} is installed and stays)")


def _manifest_ok(vdir: Path, bundle: Bundle, device_key: Path | None) -> bool:
    """The version's own manifest.json and manifest.sig are a signed pair of the bundle's content
    (the bundle's bytes, or another build of the same content verified by the same key; for an
    --insecure bundle, which can vouch for nothing, the same content). Data to check, never an
    authority: a pair that is not is rewritten from the bundle."""
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
    key = bundle.signed_by or device_key
    return key is None or signature_ok(Path(key), sig, raw)


def _keeps_signature(vdir: Path, bundle: Bundle, device_key: Path | None) -> bool:
    """An --insecure bundle's signature never replaces one that verifies its manifest with the
    device's key."""
    if bundle.signed_by is not None or device_key is None:
        return False
    try:
        return signature_ok(device_key, (vdir / "manifest.sig").read_bytes(), bundle.raw_manifest)
    except OSError:
        return False


def _fix(vdir: Path, f: Finding, store: Store, fs: Fs, bundle: Bundle | None) -> str:
    """One file made what its manifest says; what was done."""
    target, entry = vdir / f.entry.path, f.entry
    if f.bytes_bad:
        whence = _replace(vdir, f, store, fs, bundle)
    elif "link" in f.kinds or "object" in f.kinds:
        whence = _relink(vdir, f, store, fs, bundle)
    else:
        whence = ""
    try:
        if stat.S_IMODE(os.lstat(target).st_mode) != MODE:
            fs.chmod(target, MODE)  # the inode: the store's object too, where the file is linked
            whence = whence or f"mode set to {MODE:04o}"
    except OSError as exc:
        _refuse(vdir, entry, f.detail, exc)
    return f"{entry.path} (was {f.detail}; {whence})"


def _replace(vdir: Path, f: Finding, store: Store, fs: Fs, bundle: Bundle | None) -> str:
    """Bytes that cannot be trusted, or no file of its own: a link to an intact copy instead."""
    entry, target = f.entry, vdir / f.entry.path
    shown = f"versions/{vdir.name}/{entry.path}"
    bad = store.inode(target) if "content" in f.kinds else None  # a symlink's target is not damaged
    try:
        source, whence = store.source(entry, frozenset({bad} if bad else ())), "rewritten from an intact copy on this device"
    except BundleError:
        if bundle is None or not entry.carried:
            raise BundleError(f"{shown} is damaged ({f.detail}) and this device has no intact copy of its content: "
                              f"the switch to {vdir.name} is refused; the OTA state is unchanged (install "
                              f"{vdir.name}'s full bundle again: it rewrites the file)") from None
        from edge.ota.extract import refill

        refill(bundle, store, {entry.path})
        source, whence = store.object(entry.sha256), f"rewritten from {bundle.path}"
    copied = _swap(vdir, entry, f.detail, store, fs, source)
    return whence + (f", copied: {copied}" if copied else "")


def _relink(vdir: Path, f: Finding, store: Store, fs: Fs, bundle: Bundle | None) -> str:
    """A copy, or a file whose object is damaged or gone: both hashed in full first (a boot's
    check only sampled them). The copy becomes a link to the intact object; or the object is made
    from the intact copy; or, neither intact, the file is replaced as a damaged one is."""
    entry, target = f.entry, vdir / f.entry.path
    if store.intact(entry.sha256, entry.size):
        _swap(vdir, entry, f.detail, store, fs, store.object(entry.sha256))
        return "linked to its store object again"
    if sha256_file(target) != entry.sha256:
        return _replace(vdir, Finding(entry, ("content", *f.kinds), f.detail), store, fs, bundle)
    try:
        adopted = store.adopt(target, entry.sha256)
    except OSError as exc:
        _refuse(vdir, entry, f.detail, exc)
    return "its store object made again from it" if adopted else "its store object cannot be linked here"


def _swap(vdir: Path, entry: FileEntry, detail: str, store: Store, fs: Fs, source: Path) -> str | None:
    """The version's file replaced, in one rename, by a link to `source` (a copy where links are
    impossible: the reason)."""
    target = vdir / entry.path
    tmp = vdir.parent / f"{REPAIR}-{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            fs.unlink(tmp)
        copied = store.place(source, tmp)
        fs.mkdir(target.parent)
        fs.replace(tmp, target)
        fs.fsync_dir(target.parent)
    except OSError as exc:
        if os.path.lexists(tmp):
            fs.unlink(tmp)
        _refuse(vdir, entry, detail, exc)
    return copied


def _refuse(vdir: Path, entry: FileEntry, detail: str, exc: OSError) -> NoReturn:
    if exc.errno in FULL:
        raise exc  # a full file system: exit 75 from the command's lock, naming the file
    raise BundleError(f"versions/{vdir.name}/{entry.path} is damaged ({detail}) and could not be rewritten "
                      f"({exc.strerror}): the switch to {vdir.name} is refused; the OTA state is unchanged") from None
