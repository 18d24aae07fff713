"""Engines at start: find this device's engine in the store, verify, deserialize, warm up.

Each step is a phase of the start report: device (identity), engine_lookup, engine_read (bytes,
sha256 verified before anything is deserialized), cuda_context (TensorRT only), engine_deserialize.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from edge.config import Config, EngineConfig, cache_dir
from edge.device import DeviceInfo, detect
from edge.engines.key import EngineKey, device_fields
from edge.engines.runtime import EngineSession, session_from_engine
from edge.engines.store import EngineStore, StoredEngine
from edge.errors import EngineError
from edge.fsutil import sha256_file
from edge.timing import StartTimer
from edge.worker import Worker

__all__ = ["EngineWorker", "load_engines", "wanted_key", "store_for"]


class EngineWorker(Worker):
    def __init__(self, name: str, session: EngineSession, stored: StoredEngine) -> None:
        super().__init__(name)
        self.session = session
        self.stored = stored

    async def call(self, fn: Any, *args: Any) -> Any:
        self.pending += 1  # queued or running: the queue depth that /metrics shows
        try:
            return await super().call(fn, *args)
        finally:
            self.pending -= 1


def store_for(cfg: Config, e: EngineConfig) -> EngineStore:
    return EngineStore(e.store or cache_dir(cfg) / "engines")


def wanted_key(e: EngineConfig, device: DeviceInfo) -> EngineKey:
    """The key this device needs for engine `e` (from its recipe, or from the config fields)."""
    if e.recipe:
        from edge.engines.build import key_for
        from edge.engines.recipe import load_recipe

        recipe = load_recipe(e.recipe)
        return key_for(recipe, e.backend, device, sha256_file(Path(recipe.onnx)))
    precision = e.precision if e.backend == "tensorrt" else "fp32"
    return EngineKey(model=e.name, model_sha256=str(e.onnx_sha256).lower(), precision=str(precision),
                     profile=e.profile, **device_fields(e.backend, device))


def _read_verified(stored: StoredEngine) -> bytes:
    with open(stored.path, "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != stored.sha256:
        raise EngineError(f"{stored.path}: sha256 mismatch (manifest {stored.sha256[:16]}…, file "
                          f"{digest[:16]}…): the engine is corrupt and will not be deserialized")
    return data


def load_engines(cfg: Config, timer: StartTimer) -> tuple[dict[str, EngineWorker], list[dict[str, Any]]]:
    if not cfg.engines:
        return {}, []
    with timer.phase("device") as ph:
        device = detect()
        ph.detail.update({k: v for k, v in device.as_dict().items() if v})
    workers, infos = {}, []
    for e in cfg.engines:
        with timer.phase("engine_lookup", engine=e.name, backend=e.backend) as ph:
            stored = store_for(cfg, e).find(wanted_key(e, device))
            ph.detail["file"] = stored.path.name
        with timer.phase("engine_read", engine=e.name) as ph:
            data = _read_verified(stored)
            ph.bytes = len(data)
            ph.detail["sha256"] = "verified"
        if e.backend == "tensorrt":
            with timer.phase("cuda_context", engine=e.name):
                import pycuda.autoinit  # noqa: F401  (the CUDA context, timed on its own)
        with timer.phase("engine_deserialize", engine=e.name, backend=e.backend):
            session = session_from_engine(stored, data)
        workers[e.name] = EngineWorker(e.name, session, stored)
        infos.append({"name": e.name, "backend": e.backend, "engine": str(stored.path),
                      "bytes": stored.bytes, "key": stored.key.as_dict(), "pid": os.getpid()})
    return workers, infos
