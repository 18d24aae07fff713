"""A model file before llama.cpp sees it: builtin resolution, page-in, GGUF validation, sha256.

`builtin:NAME` (the table in edge.builtin_models) becomes a real file (assembled atomically on
first use). Page-in threads read the file into the page cache while the start goes on
(edge.model.pagein), the header is validated from the warming pages (edge.model.gguf), and a configured
sha256 is checked by one more reader.

Checksum policy: hashing a multi-GB model at every start would cost seconds of cold start, so a
file whose sha256 was verified once is remembered by (device, inode, size, mtime) in the cache
dir; a changed or replaced file is hashed again, and a mismatch is a ModelError (exit 65).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from edge.builtin_models import BUILTINS
from edge.config import BUILTIN_PREFIX, ModelConfig
from edge.errors import ConfigError, ModelError
from edge.fsutil import atomic_write, file_identity
from edge.model.gguf import GGUFInfo, read_gguf_info
from edge.model.pagein import PageIn, PageInResult

__all__ = ["ModelFile", "resolve_model", "VerifiedCache"]


def resolve_model(m: ModelConfig, cache_dir: Path, verified: "VerifiedCache") -> ModelConfig:
    """Turn `builtin:NAME` into a real file (assembled atomically on first use) with its sha256."""
    if not m.path.startswith(BUILTIN_PREFIX):
        return m
    name = m.path[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise ConfigError("config", "models.path", f"unknown builtin model {name!r}; "
                          f"expected one of {[BUILTIN_PREFIX + n for n in BUILTINS]}")
    filename, source, template = BUILTINS[name]
    target = cache_dir / "models" / filename
    expected, assemble = source(target)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{filename}.{os.getpid()}.partial")
        try:
            assemble(tmp, overwrite=True)  # verifies the sha256 of what it wrote
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except ValueError as exc:
            raise ModelError(str(target), f"assembling the builtin model failed: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        verified.remember(target, expected)
    return dataclasses.replace(m, path=str(target), sha256=m.sha256 or expected,
                               chat_template=m.chat_template or template)


class VerifiedCache:
    """sha256 digests already verified, and GGUF headers already validated, keyed by file
    identity; stored as JSON in the cache dir. A header is kept with its identity including the
    ctime, which any write to the file, chmod or rename onto it changes (and no user-space call
    can set back): the same identity is the same bytes, validated once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._data = {}

    @staticmethod
    def _identity(file: Path) -> list[int]:
        return list(file_identity(file))  # a list: what the JSON file gives back to compare with

    def is_verified(self, file: Path, sha256: str) -> bool:
        entry = self._data.get(str(file))
        try:
            return bool(entry) and entry.get("sha256") == sha256.lower() and \
                entry["id"] == self._identity(file)
        except OSError:
            return False

    def remember(self, file: Path, sha256: str) -> None:
        self._data[str(file)] = {**self._entry(file), "sha256": sha256.lower(), "id": self._identity(file)}
        self._save()

    def _entry(self, file: Path) -> dict[str, Any]:
        entry = self._data.get(str(file))
        return entry if isinstance(entry, dict) else {}

    @staticmethod
    def _header_identity(file: Path) -> list[int]:
        return list(file_identity(file, ctime=True))

    def header(self, file: Path) -> GGUFInfo | None:
        """The GGUF header validated earlier for this very file (identity), or None."""
        gguf = self._entry(file).get("gguf")
        try:
            if not isinstance(gguf, dict) or gguf.get("id") != self._header_identity(file):
                return None
        except OSError:
            return None
        return GGUFInfo.from_json(str(file), gguf.get("info"))

    def remember_header(self, file: Path, info: GGUFInfo) -> None:
        try:
            ident = self._header_identity(file)
        except OSError:
            return
        self._data[str(file)] = {**self._entry(file), "gguf": {"id": ident, "info": info.as_json()}}
        self._save()

    def _save(self) -> None:
        # files since removed (an OTA version pruned, a model replaced) are forgotten: the file
        # holds what is on the device, not every path it ever served
        self._data = {k: v for k, v in self._data.items() if os.path.lexists(k)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(self._data, indent=1))
        except OSError:
            pass  # a read-only cache only costs a re-hash next start


class ModelFile:
    """One resolved model file on its way in: `start()` the page-in (and the hash, when the
    policy asks for one), `validate()` its GGUF header meanwhile, then `finish()`."""

    def __init__(self, m: ModelConfig, verified: VerifiedCache) -> None:
        self.cfg = m
        self.verified = verified
        self.pagein: PageIn | None = None
        self.info: GGUFInfo | None = None
        self.validated_earlier = False  # the header as validated by an earlier start (same file identity)

    def needs_hash(self) -> bool:
        """A sha256 is configured and this very file (identity) was not verified against it."""
        return bool(self.cfg.sha256) and os.path.isfile(self.cfg.path) and \
            not self.verified.is_verified(Path(self.cfg.path), self.cfg.sha256)

    def start(self) -> "ModelFile":
        # Reading starts before validation so that validation itself reads from warm pages;
        # a file that fails validation only cost some reads.
        m = self.cfg
        threads = m.prefetch_threads if m.prefetch else 0
        need_hash = self.needs_hash()
        if (threads or need_hash) and os.path.isfile(m.path):
            self.pagein = PageIn(m.path, threads=threads, hash_sha256=need_hash).start()
        return self

    def validate(self) -> GGUFInfo:
        """The GGUF header validated (edge.model.gguf), or as validated earlier for this very file."""
        file = Path(self.cfg.path)
        self.info = self.verified.header(file)
        self.validated_earlier = self.info is not None
        if self.info is None:
            self.info = read_gguf_info(file)
            self.verified.remember_header(file, self.info)
        return self.info

    def finish(self) -> PageInResult | None:
        """Join the page-in; compare and remember the sha256 if one was computed."""
        if self.pagein is None:
            return None
        res = self.pagein.result()
        if res.sha256 is not None:
            expected = str(self.cfg.sha256).lower()
            if res.sha256 != expected:
                raise ModelError(self.cfg.path, f"sha256 mismatch: expected {self.cfg.sha256}, found {res.sha256}")
            self.verified.remember(Path(self.cfg.path), res.sha256)
        return res

