"""The refusals of an install that depend on this device, made before anything is written (and
again under the lock, after a pending version was rolled back): the update policy (a version
installed before with other content; a downgrade below the highest version ever committed,
unless `--allow-downgrade`), a thin bundle's content this device lacks, and free space."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.ota.bundle import Bundle, signature_ok
from edge.ota.errors import BundleError, PolicyError
from edge.ota.manifest import content_digest
from edge.ota.statefile import read_marker
from edge.ota.store import Store
from edge.ota.version import highest, parse_version

__all__ = ["check_policy", "check_content", "refuse"]


def _installed_digest(versions: Path, bundle: Bundle, st: dict[str, Any]) -> str | None:
    """What this device installed as the bundle's version: the state's record first; the version's
    own manifest only where no record is kept and its manifest.sig verifies it with the key that
    verified the bundle (a damaged or unsigned manifest is data the install repairs, never an
    authority that locks the version's own signed bundle out)."""
    if bundle.version in st["digests"]:
        return str(st["digests"][bundle.version])
    vdir = versions / bundle.version
    try:
        raw = (vdir / "manifest.json").read_bytes()
        manifest = json.loads(raw)
        sig = (vdir / "manifest.sig").read_bytes() if bundle.signed_by else b""
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    if bundle.signed_by and not signature_ok(Path(bundle.signed_by), sig, raw):
        return None
    return content_digest(manifest)


def check_policy(versions: Path, bundle: Bundle, st: dict[str, Any], allow_downgrade: bool) -> None:
    v = bundle.parsed_version
    known = _installed_digest(versions, bundle, st)
    if known is not None and known != bundle.content_digest:
        raise PolicyError(f"{bundle.path}: version {v} was installed on this device before with "
                          "other content: a new content needs a new version")
    floor = highest(st["highest"], st["current"])
    if floor and v < parse_version(floor) and not allow_downgrade:
        raise PolicyError(f"{bundle.path}: version {v} is older than {floor}, the highest "
                          "version this device has committed (a downgrade, or the replay of an "
                          "old bundle): pass --allow-downgrade to install it on purpose")


def check_content(store: Store, bundle: Bundle) -> None:
    """A thin bundle: every file it does not carry must be on this device, named if not."""
    missing = store.missing(bundle.files)
    if missing:
        base = bundle.base or {}
        raise BundleError(
            f"{bundle.path}: a thin bundle (base {base.get('bundle_version')}) whose content this "
            f"device does not have intact: {'; '.join(f'{f.path} (sha256 {f.sha256[:16]}…, {f.size} bytes)' for f in missing)}. "
            "Nothing was written: install the full bundle, or one built on a version this device has")


def refuse(versions: Path, store: Store, bundle: Bundle, st: dict[str, Any], allow_downgrade: bool) -> None:
    """Every refusal that depends on this device; reads only."""
    from edge.ota.extract import check_free_space

    check_policy(versions, bundle, st, allow_downgrade)
    if st["current"] == bundle.version:
        return
    check_content(store, bundle)
    if not read_marker(versions / bundle.version):  # on disk already: nothing to write but repairs
        check_free_space(bundle, store, versions)
