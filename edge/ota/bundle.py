"""The bundle format (.edgeb): an uncompressed tar whose first two members are manifest.json
and manifest.sig (Ed25519 over the manifest's exact bytes), then files/<path> for every file
the manifest lists with its sha256 and size. Reading verifies the signature before any file is
touched; each file is hashed while it is extracted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.fsutil import sha256_file
from edge.ota.errors import BundleError
from edge.ota.version import Version, parse_version

__all__ = ["BundleError", "Bundle", "FileEntry", "build_bundle", "content_digest", "keygen", "open_bundle"]

FORMAT = 1
MAX_MANIFEST = 16 << 20  # a manifest lists files; more than this is not a manifest


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, under files/ in the tar and under the version dir once installed
    sha256: str
    size: int
    kind: str  # model | engine | recipe | other
    key: dict[str, Any] | None = None  # engines: the EngineKey they are for


def _crypto() -> Any:
    from edge.errors import require

    purpose = "signing and verifying OTA bundles"
    return (require("cryptography.hazmat.primitives.serialization", None, purpose),
            require("cryptography.hazmat.primitives.asymmetric.ed25519", None, purpose))


def keygen(private: Path) -> Path:
    """Write an Ed25519 key pair: PRIVATE (PEM, mode 0600) and PRIVATE.pub (PEM)."""
    serialization, ed25519 = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = private.with_name(private.name + ".pub")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return pub


def _load_private(path: Path) -> Any:
    serialization, _ = _crypto()
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: not a usable Ed25519 private key ({exc})") from None


def _load_public(path: Path) -> Any:
    serialization, _ = _crypto()
    try:
        return serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: not a usable Ed25519 public key ({exc})") from None


def build_bundle(out: Path, *, version: str, files: list[tuple[Path, str, str, dict[str, Any] | None]],
                 config: str, key: Path, min_edge_version: str = "0.1.0") -> dict[str, Any]:
    """files: (source, path in bundle, kind, engine key or None). Written atomically to `out`."""
    from edge.config import parse_config

    parse_config(config, source="bundle config fragment")  # a bundle never ships a config that fails
    parse_version(version, "--version")
    parse_version(min_edge_version, "min_edge_version")
    entries = [FileEntry(rel, sha256_file(src), src.stat().st_size, kind, k) for src, rel, kind, k in files]
    for e in entries:
        if e.path.startswith("/") or ".." in Path(e.path).parts:
            raise BundleError(f"bundle path {e.path!r} must be relative and stay inside the bundle")
    manifest = {"format": FORMAT, "bundle_version": version, "min_edge_version": min_edge_version,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": [e.__dict__ for e in entries], "config": config}
    raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
    sig = _load_private(key).sign(raw)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("manifest.json", raw), ("manifest.sig", sig)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
        for (src, rel, _, _), e in zip(files, entries):
            info = tar.gettarinfo(str(src), arcname=f"files/{rel}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(src, "rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, out)
    return manifest


@dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any]
    raw_manifest: bytes
    signed_by: str | None  # the public key file that verified it; None when --insecure

    @property
    def version(self) -> str:
        return str(self.manifest["bundle_version"])  # validated by open_bundle

    @property
    def parsed_version(self) -> Version:
        return parse_version(self.version)

    @property
    def content_digest(self) -> str:
        """What the bundle installs (files, config, requirement), not when it was built: two
        bundles of one version with another digest are different content under one name."""
        return content_digest(self.manifest)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def files(self) -> list[FileEntry]:
        return [FileEntry(**f) for f in self.manifest["files"]]


def content_digest(manifest: dict[str, Any]) -> str:
    body = {k: manifest.get(k) for k in ("files", "config", "min_edge_version")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def open_bundle(path: Path, pubkey: Path | None, *, insecure: bool = False) -> Bundle:
    """Read and verify the manifest (signature first); files are verified by extract_files()."""
    try:
        tar = tarfile.open(path, "r:")
    except FileNotFoundError:
        raise BundleError(f"{path}: bundle does not exist") from None
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{path}: not an edge bundle (tar): {exc}") from None
    with tar:
        try:
            first, second = tar.next(), tar.next()
        except (tarfile.TarError, OSError) as exc:
            raise BundleError(f"{path}: truncated or corrupt bundle: {exc}") from None
        if first is None or first.name != "manifest.json" or second is None or second.name != "manifest.sig":
            raise BundleError(f"{path}: expected manifest.json then manifest.sig as the first members")
        if not (first.isfile() and second.isfile()) or first.size > MAX_MANIFEST or second.size > 1024:
            raise BundleError(f"{path}: manifest.json/manifest.sig are not small regular files")
        try:
            raw = tar.extractfile(first).read()  # type: ignore[union-attr]
            sig = tar.extractfile(second).read()  # type: ignore[union-attr]
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BundleError(f"{path}: truncated or corrupt bundle inside its manifest: {exc}") from None
        if len(raw) != first.size or len(sig) != second.size:
            raise BundleError(f"{path}: truncated bundle inside manifest.json/manifest.sig")
    signed_by = None
    if pubkey is not None:
        from cryptography.exceptions import InvalidSignature

        try:
            _load_public(pubkey).verify(sig, raw)
        except InvalidSignature:
            raise BundleError(f"{path}: signature does not verify with {pubkey}: the bundle was "
                              "tampered with or signed by another key") from None
        signed_by = str(pubkey)
    elif not insecure:
        raise BundleError(f"{path}: refusing an unverified bundle: pass --pubkey (or --insecure)")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise BundleError(f"{path}: manifest.json is not JSON: {exc}") from None
    for field in ("format", "bundle_version", "files", "config"):
        if field not in manifest:
            raise BundleError(f"{path}: manifest.json lacks {field!r}")
    if manifest["format"] != FORMAT:
        raise BundleError(f"{path}: bundle format {manifest['format']}, this edge reads format {FORMAT}")
    parse_version(manifest["bundle_version"], f"{path}: bundle_version")
    parse_version(manifest.get("min_edge_version", "0.0.0"), f"{path}: min_edge_version")
    _check_files(path, manifest["files"])
    return Bundle(path, manifest, raw, signed_by)


def _check_files(path: Path, files: Any) -> None:
    """Field types of the signed file list: sizes bound extraction, so they must be sane."""
    if not isinstance(files, list):
        raise BundleError(f"{path}: manifest files must be a list")
    seen: set[str] = set()
    for f in files:
        if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                and f["size"] >= 0 and isinstance(f.get("sha256"), str) and isinstance(f.get("kind"), str)):
            raise BundleError(f"{path}: manifest file entry {f!r}: expected path, sha256, size >= 0, kind")
        rel = f["path"]
        if not rel or rel.startswith("/") or ".." in Path(rel).parts or rel in seen:
            raise BundleError(f"{path}: manifest path {rel!r} is empty, absolute, leaves the bundle or repeats")
        seen.add(rel)
