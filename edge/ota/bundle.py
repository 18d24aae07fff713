"""The bundle format (.edgeb): an uncompressed tar whose first two members are manifest.json
and manifest.sig (Ed25519 over the manifest's exact bytes), then files/<path> for every file
the manifest lists with its sha256 and size and carries (a thin bundle lists every file of the
version but carries only those its base lacks: the signature covers the full list). Reading
verifies the signature before any file is touched; each file is hashed while it is extracted.
What a valid manifest is: edge.ota.manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.fsutil import sha256_file
from edge.ota.errors import BundleError
from edge.ota.manifest import FORMAT_FULL, FORMAT_THIN, FileEntry, check_files, content_digest
from edge.ota.version import Version, parse_version

__all__ = ["BundleError", "Bundle", "FileEntry", "build_bundle", "content_digest", "keygen", "open_bundle",
           "signature_ok"]

MAX_MANIFEST = 16 << 20  # a manifest lists files; more than this is not a manifest


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
    pub = private.with_name(private.name + ".pub")
    _new_file(private, pem, 0o600)  # whole or absent, and never over a key that is there
    from edge.fsutil import atomic_write

    atomic_write(pub, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return pub


def _new_file(path: Path, data: bytes, mode: int) -> None:
    """`path` made with `data`, atomically (a temp file, fsynced, then linked: EEXIST where a file
    is there, which stays untouched); a failure leaves no temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


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


def signature_ok(pubkey: Path, sig: bytes, raw: bytes) -> bool:
    """Does `sig` (Ed25519) verify `raw` with the public key in `pubkey`?"""
    from cryptography.exceptions import InvalidSignature

    try:
        _load_public(pubkey).verify(sig, raw)
    except InvalidSignature:
        return False
    return True


def build_bundle(out: Path, *, version: str, files: list[tuple[Path, str, str, dict[str, Any] | None]],
                 config: str, key: Path, min_edge_version: str = "0.1.0",
                 base: dict[str, Any] | None = None, source: str = "bundle config fragment",
                 check: Callable[["Bundle"], None] | None = None) -> dict[str, Any]:
    """files: (source, path in bundle, kind, engine key or None). With `base` (an earlier
    bundle's manifest) the bundle is thin: it lists every file but carries only those whose
    content the base does not have. `check` sees the unsigned bundle before anything is
    written (the CLI's: the checks a device makes). Written atomically to `out`: a write that
    fails for any reason leaves no temp file."""
    from edge.config import parse_config

    parse_config(config, source=source)  # a bundle never ships a config that fails
    parse_version(version, "--version")
    parse_version(min_edge_version, "min_edge_version")
    have = {(f["sha256"], f["size"]) for f in base["files"]} if base else set()
    entries = []
    for src, rel, kind, k in files:
        digest, size = sha256_file(src), src.stat().st_size
        entries.append(FileEntry(rel, digest, size, kind, k, carried=(digest, size) not in have))
    manifest: dict[str, Any] = {
        "format": FORMAT_THIN if base else FORMAT_FULL, "bundle_version": version,
        "min_edge_version": min_edge_version, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": [e.as_dict() for e in entries], "config": config}
    if base:
        manifest["base"] = {"bundle_version": base["bundle_version"], "content_digest": content_digest(base)}
    check_files("bundle", manifest)  # the same path rules the device applies
    raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
    if check is not None:
        check(Bundle(Path(source), manifest, raw, None))
    sig = _load_private(key).sign(raw)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_tar(tmp, raw, sig, [(src, rel) for (src, rel, _, _), e in zip(files, entries) if e.carried])
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return manifest


def _write_tar(tmp: Path, raw: bytes, sig: bytes, carried: list[tuple[Path, str]]) -> None:
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("manifest.json", raw), ("manifest.sig", sig)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
        for src, rel in carried:
            info = tar.gettarinfo(str(src), arcname=f"files/{rel}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(src, "rb") as f:
                tar.addfile(info, f)


@dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any]
    raw_manifest: bytes
    signed_by: str | None  # the public key file that verified it; None when --insecure
    signature: bytes = b""  # manifest.sig: kept beside the installed manifest for `edge ota verify`

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

    @property
    def base(self) -> dict[str, Any] | None:
        """A thin bundle's base: {bundle_version, content_digest}; None for a full bundle."""
        return self.manifest.get("base")


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
        if not signature_ok(pubkey, sig, raw):
            raise BundleError(f"{path}: signature does not verify with {pubkey}: the bundle was "
                              "tampered with or signed by another key")
        signed_by = str(pubkey)
    elif not insecure:
        raise BundleError(f"{path}: refusing an unverified bundle: pass --pubkey (or --insecure)")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise BundleError(f"{path}: manifest.json is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: manifest.json is not a JSON object")
    for field in ("format", "bundle_version", "files", "config"):
        if field not in manifest:
            raise BundleError(f"{path}: manifest.json lacks {field!r}")
    if not isinstance(manifest["config"], str):
        raise BundleError(f"{path}: manifest config must be the config's TOML text")
    if manifest["format"] not in (FORMAT_FULL, FORMAT_THIN):
        raise BundleError(f"{path}: bundle format {manifest['format']}, this edge reads formats "
                          f"{FORMAT_FULL} (full) and {FORMAT_THIN} (thin)")
    parse_version(manifest["bundle_version"], f"{path}: bundle_version")
    parse_version(manifest.get("min_edge_version", "0.0.0"), f"{path}: min_edge_version")
    check_files(path, manifest)
    return Bundle(path, manifest, raw, signed_by, sig)

