"""The engine store: <store>/<model>/<model-sha256[:16]>/<key filename> + manifest.json.

An engine is visible only through its manifest entry, and the manifest changes by atomic rename
alone: a replaced engine's entry is removed before its file is renamed over, and the new entry
is added after. A reader never sees an entry whose file is half-written or not the one hashed.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.engines.key import EngineKey
from edge.fsutil import atomic_write, fsync_dir, sha256_file
from edge.errors import EngineError

__all__ = ["EngineStore", "StoredEngine", "sha256_file"]

MANIFEST = "manifest.json"
STRAY_AGE_S = 600


@dataclass(frozen=True)
class StoredEngine:
    key: EngineKey
    path: Path
    sha256: str
    bytes: int
    meta: dict[str, Any]


class EngineStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def folder(self, model: str, model_sha256: str) -> Path:
        return self.root / model / model_sha256[:16]

    # -- manifest ----------------------------------------------------------------------------
    def _manifest(self, folder: Path) -> dict[str, Any]:
        try:
            data = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            return {"engines": {}}
        except ValueError as exc:
            raise EngineError(f"{folder / MANIFEST}: corrupt manifest ({exc})") from None
        if not isinstance(data.get("engines"), dict):
            raise EngineError(f"{folder / MANIFEST}: expected an 'engines' table")
        return data

    def _save_manifest(self, folder: Path, data: dict[str, Any]) -> None:
        atomic_write(folder / MANIFEST, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=None)

    @contextmanager
    def _locked(self, folder: Path) -> Iterator[None]:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- write -------------------------------------------------------------------------------
    def put(self, key: EngineKey, source: Path, build: dict[str, Any] | None = None) -> StoredEngine:
        """Move a finished engine file (on the same filesystem, e.g. from tmp_path()) into place."""
        folder = self.folder(key.model, key.model_sha256)
        name = key.filename()
        with self._locked(folder):
            with open(source, "rb") as f:
                os.fsync(f.fileno())
            digest, size = sha256_file(source), source.stat().st_size
            manifest = self._manifest(folder)
            if manifest["engines"].pop(name, None) is not None:
                self._save_manifest(folder, manifest)  # the old entry goes before its file does
            os.replace(source, folder / name)
            fsync_dir(folder)
            meta = {"key": key.as_dict(), "sha256": digest, "bytes": size, "build": build or {},
                    "builder_host": socket.gethostname(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            manifest["engines"][name] = meta
            self._save_manifest(folder, manifest)
        return StoredEngine(key, folder / name, digest, size, meta)

    def rekey(self, e: StoredEngine, key: EngineKey) -> StoredEngine:
        """Give a stored engine another key (same model and bytes: `edge engines rekey`). Its entry
        goes before its file is renamed and the new one comes after, as in put(); the bytes are
        checked against the manifest's sha256 first, so a corrupt file is not given a new name."""
        self.verify(e)
        folder, name = e.path.parent, key.filename()
        with self._locked(folder):
            manifest = self._manifest(folder)
            if manifest["engines"].pop(e.path.name, None) is not None:
                self._save_manifest(folder, manifest)
            os.replace(e.path, folder / name)
            fsync_dir(folder)
            meta = {**e.meta, "key": key.as_dict(), "rekeyed_from": e.key.as_dict()}
            manifest["engines"][name] = meta
            self._save_manifest(folder, manifest)
        return StoredEngine(key, folder / name, e.sha256, e.bytes, meta)

    def tmp_path(self, key: EngineKey) -> Path:
        """Where a build writes its output: the store's folder (same filesystem), hidden name."""
        folder = self.folder(key.model, key.model_sha256)
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f".{key.filename()}.{os.getpid()}.building"

    # -- read --------------------------------------------------------------------------------
    def entries(self) -> list[StoredEngine]:
        out = []
        for man in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            for name, meta in self._manifest(man.parent)["engines"].items():
                out.append(StoredEngine(EngineKey.from_dict(meta["key"]), man.parent / name,
                                        meta["sha256"], meta["bytes"], meta))
        return out

    def find(self, wanted: EngineKey) -> StoredEngine:
        """The engine that runs on the device `wanted` describes (EngineKey.differences is the
        rule), found by its ONNX's sha256 whatever the model is called; an exact key first, then
        one under the wanted name, then any. Otherwise an error that says which field differs."""
        entries = self.entries()
        same_model = [e for e in entries if e.key.model_sha256 == wanted.model_sha256]
        fitting = [e for e in same_model if not e.key.differences(wanted)]
        if fitting:
            return min(fitting, key=lambda e: (e.key != wanted, e.key.model != wanted.model))
        held = [e for e in entries if e.key.model == wanted.model or e in same_model]
        listing = "; ".join(f"{e.key.filename()} (model sha {e.key.model_sha256[:12]})" for e in held) \
            or "nothing"
        if not same_model:
            why = (f"no engine for model {wanted.model!r} with sha256 {wanted.model_sha256[:12]}… "
                   f"in {self.root}")
        else:
            closest = min(same_model, key=lambda e: len(e.key.differences(wanted)))
            why = f"no matching engine for {wanted.model!r}: " + "; ".join(closest.key.differences(wanted))
        raise EngineError(f"{why}. The store holds for this model: {listing}. "
                          "Build one on the build host with `edge build-engine` for this device's key.")

    def timing_cache(self, key: EngineKey) -> Path:
        """Where TensorRT's timing cache for this GPU and TensorRT version lives: beside the
        engines (tactic timings are per GPU and TensorRT version, never per recipe)."""
        parts = [key.target, key.platform, f"trt{key.tensorrt}"]
        return self.root / "timing-caches" / ("-".join(p for p in parts if p) + ".cache")

    def verify(self, e: StoredEngine) -> None:
        try:
            actual = sha256_file(e.path)
        except FileNotFoundError:
            raise EngineError(f"{e.path}: listed in the manifest but missing") from None
        if actual != e.sha256:
            raise EngineError(f"{e.path}: sha256 mismatch (manifest {e.sha256[:16]}…, file "
                              f"{actual[:16]}…): the engine is corrupt and will not be deserialized")

    # -- housekeeping ------------------------------------------------------------------------
    def remove(self, e: StoredEngine) -> None:
        folder = e.path.parent
        with self._locked(folder):
            manifest = self._manifest(folder)
            manifest["engines"].pop(e.path.name, None)
            self._save_manifest(folder, manifest)  # invisible first, then gone
            e.path.unlink(missing_ok=True)

    def gc(self, keep: int, in_use: set[str]) -> list[StoredEngine]:
        """Per model, keep the `keep` newest engines plus every one in use; remove the rest and
        any stray file no manifest lists (an interrupted build)."""
        removed = []
        by_model: dict[str, list[StoredEngine]] = {}
        for e in self.entries():
            by_model.setdefault(e.key.model, []).append(e)
        for engines in by_model.values():
            engines.sort(key=lambda e: e.meta.get("created", ""), reverse=True)
            for e in engines[keep:]:
                if str(e.path) not in in_use:
                    self.remove(e)
                    removed.append(e)
        for folder in (d for d in self.root.glob("*/*") if d.is_dir()):
            listed = set(self._manifest(folder)["engines"])
            for f in folder.iterdir():
                stray = f.name not in listed and f.name not in (MANIFEST, ".lock") and \
                    (f.name.endswith((".building", ".tmp")) or f.suffix in (".engine", ".ort"))
                if stray and time.time() - f.stat().st_mtime > STRAY_AGE_S:  # not a build running now
                    f.unlink(missing_ok=True)
        return removed


def format_table(entries: list[StoredEngine]) -> str:
    """`edge engines ls`: one row per engine (key fields, size, created, builder)."""
    lines = [f"{'model':<16}{'backend':<13}{'target':<14}{'runtime':<22}{'prec':<6}{'MB':>8}  created  builder"]
    for e in entries:
        k = e.key
        rt = f"cuda{k.cuda} trt{k.tensorrt}" if k.backend == "tensorrt" else f"ort{k.onnxruntime}"
        lines.append(f"{k.model:<16}{k.backend:<13}{k.target:<14}{rt:<22}{k.precision:<6}"
                     f"{e.bytes / 1e6:>8.2f}  {e.meta.get('created')}  {e.meta.get('builder_host')}")
    return "\n".join(lines)
