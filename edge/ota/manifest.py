"""What a bundle's signed manifest says, and what makes one valid: the file list (every file of
the version with its sha256 and size, carried in the bundle or, in a thin bundle, expected on the
device), the rules for the paths in it, and the content digest that names what a version installs.

Paths are checked here, once, for build, inspect and install alike, so that every bundle gets
the same verdict wherever it is read: relative, no empty, `.` or `..` component, each component
at most NAME_MAX bytes, at most MAX_DEPTH components and MAX_PATH bytes in all (the OTA root's
own path must still fit under PATH_MAX), no file under another file's path, and none of the names
the installer writes beside the files at the top of a version directory.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.ota.errors import BundleError

__all__ = ["FileEntry", "FORMAT_FULL", "FORMAT_THIN", "RESERVED", "check_files", "check_path",
           "content_digest", "read_base", "shown"]

FORMAT_FULL = 1  # every file is in the bundle
FORMAT_THIN = 2  # some files are only listed: the device has them (an older edge refuses it by format)
NAME_MAX = 255  # bytes of one path component (ext4, xfs, tmpfs, f2fs)
MAX_DEPTH = 32
MAX_PATH = 1024  # bytes of a path inside the bundle
RESERVED = ("edge.toml", "manifest.json", "manifest.sig", ".complete", ".link", ".sampled")  # the installer's own


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, under files/ in the tar and under the version dir once installed
    sha256: str
    size: int
    kind: str  # model | engine | recipe | other
    key: dict[str, Any] | None = None  # engines: the EngineKey they are for
    carried: bool = True  # False: a thin bundle's file the device already has (by sha256)

    def as_dict(self) -> dict[str, Any]:
        d = {"path": self.path, "sha256": self.sha256, "size": self.size, "kind": self.kind, "key": self.key}
        return d if self.carried else {**d, "carried": False}


def shown(name: str, limit: int = 120) -> str:
    """A path for a message: a hostile 5,000-character name is cut, and its length said."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}… ({len(name)} characters)"


def check_path(rel: object) -> str | None:
    """What is wrong with a manifest path, or None."""
    if not isinstance(rel, str) or not rel:
        return "is empty or not a string"
    if "\0" in rel:
        return "contains a NUL byte"
    if rel.startswith("/"):
        return "is absolute"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component (it must stay inside the version directory)"
    if len(parts) > MAX_DEPTH:
        return f"is {len(parts)} levels deep, more than {MAX_DEPTH}"
    size = len(rel.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH:
        return f"is {size} bytes long, more than {MAX_PATH}"
    longest = max(parts, key=lambda p: len(p.encode("utf-8", "surrogatepass")))
    if len(longest.encode("utf-8", "surrogatepass")) > NAME_MAX:
        return (f"has a component of {len(longest.encode('utf-8', 'surrogatepass'))} bytes, longer than "
                f"the {NAME_MAX} a file name may have")
    if len(parts) == 1 and rel in RESERVED:
        return "is a name the installer writes itself in a version directory"
    return None


def _entry_problem(f: Any) -> str | None:
    if not (isinstance(f, dict) and isinstance(f.get("sha256"), str) and len(f["sha256"]) == 64
            and isinstance(f.get("size"), int) and not isinstance(f["size"], bool) and f["size"] >= 0
            and isinstance(f.get("kind"), str) and isinstance(f.get("carried", True), bool)
            and set(f) <= {"path", "sha256", "size", "kind", "key", "carried"}):
        return "expected path, sha256 (64 hex digits), size >= 0, kind, key, carried (true/false)"
    if set(f["sha256"]) - set("0123456789abcdef"):
        return "sha256 is not 64 lowercase hex digits"
    return None


def check_files(source: Path | str, manifest: dict[str, Any]) -> None:
    """The signed file list: field types (sizes bound extraction), paths, and a thin bundle's base."""
    files = manifest["files"]
    if not isinstance(files, list):
        raise BundleError(f"{source}: manifest files must be a list")
    seen: set[str] = set()
    dirs: set[str] = set()
    for f in files:
        problem = _entry_problem(f)
        if problem:
            raise BundleError(f"{source}: manifest file entry {shown(json.dumps(f, default=str))}: {problem}")
        problem = check_path(f.get("path"))
        if problem:
            raise BundleError(f"{source}: manifest path {shown(str(f.get('path')))} {problem}")
        if f["path"] in seen:
            raise BundleError(f"{source}: manifest path {shown(f['path'])} appears twice")
        seen.add(f["path"])
        parts = f["path"].split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(seen & dirs)
    if clash:
        raise BundleError(f"{source}: manifest path {shown(clash[0])} is a file and also a directory of other files")
    base = manifest.get("base")
    if base is not None and not (isinstance(base, dict) and isinstance(base.get("bundle_version"), str)
                                 and isinstance(base.get("content_digest"), str)):
        raise BundleError(f"{source}: manifest base must be {{bundle_version, content_digest}}")
    thin = any(not f.get("carried", True) for f in files)
    if thin and (manifest.get("format") != FORMAT_THIN or not isinstance(manifest.get("base"), dict)):
        raise BundleError(f"{source}: files marked not carried, but the manifest is not a thin bundle's "
                          f"(format {FORMAT_THIN} with a base)")


def content_digest(manifest: dict[str, Any]) -> str:
    """What a version installs (files, config, requirement), not how it was shipped: a thin and a
    full bundle of one version have the same digest, and the build time does not count."""
    files = [{k: v for k, v in f.items() if k != "carried"} for f in manifest.get("files") or []]
    body = {"files": files, "config": manifest.get("config"), "min_edge_version": manifest.get("min_edge_version")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_base(path: Path) -> dict[str, Any]:
    """The manifest of a thin bundle's base: an earlier bundle (its first member) or that
    manifest saved as JSON (e.g. a device's versions/<V>/manifest.json)."""
    try:
        if tarfile.is_tarfile(path):
            with tarfile.open(path, "r:") as tar:
                first = tar.next()
                if first is None or first.name != "manifest.json" or not first.isfile():
                    raise BundleError(f"--base {path}: a tar, but not an edge bundle (no manifest.json first)")
                raw = tar.extractfile(first).read()  # type: ignore[union-attr]
        else:
            raw = path.read_bytes()
        manifest = json.loads(raw)
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise BundleError(f"--base {path}: not a bundle or a bundle manifest: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list) \
            or "bundle_version" not in manifest:
        raise BundleError(f"--base {path}: expected a bundle manifest (bundle_version, files)")
    check_files(path, manifest)
    return manifest
