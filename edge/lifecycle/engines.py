"""Engines at start: find this device's engine in the store, verify, deserialize on the worker.

Each step is a phase of the start report: device (identity), engine_lookup, engine_read (bytes,
sha256 verified before anything is deserialized), engine_deserialize. Deserialization runs on
the engine's worker thread — for TensorRT that is where the GPU's primary context is made
current, the buffers allocated, and later every request and the teardown run.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from edge.config import Config, EngineConfig
from edge.device.identity import DeviceInfo, detect
from edge.engines.key import key_for
from edge.engines.lookup import configured_engines, store_for
from edge.engines.store import StoredEngine
from edge.errors import EngineError
from edge.timing import Phases, StartTimer
from edge.serve.worker import EngineWorker

__all__ = ["EngineWorker", "configured_engines", "load_engines", "store_for", "read_verified"]


def read_verified(stored: StoredEngine) -> bytes:
    with open(stored.path, "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != stored.sha256:
        raise EngineError(f"{stored.path}: sha256 mismatch (manifest {stored.sha256[:16]}…, file "
                          f"{digest[:16]}…): the engine is corrupt and will not be deserialized")
    return data


def load_engines(cfg: Config, timer: StartTimer, only: list[EngineConfig] | None = None
                 ) -> tuple[dict[str, EngineWorker], list[dict[str, Any]]]:
    """The engines of `cfg` (or the `only` ones of them: a reload's changed ones), each on its worker."""
    engines = cfg.engines if only is None else only
    if not engines:
        return {}, []
    with timer.phase(Phases.DEVICE) as ph:
        device = detect()
        ph.detail.update({k: v for k, v in device.as_dict().items() if v})
    workers: dict[str, EngineWorker] = {}
    infos: list[dict[str, Any]] = []
    try:
        for e in engines:
            infos.append(_load_one(cfg, e, device, timer, workers))
    except BaseException:
        for w in workers.values():  # engines already up are torn down on their threads
            w.close()
        raise
    return workers, infos


def _load_one(cfg: Config, e: EngineConfig, device: DeviceInfo, timer: StartTimer,
              workers: dict[str, EngineWorker]) -> dict[str, Any]:
    with timer.phase(Phases.ENGINE_LOOKUP, engine=e.name, backend=e.backend) as ph:
        stored = store_for(cfg, e).find(key_for(e, device))
        ph.detail["file"] = stored.path.name
    with timer.phase(Phases.ENGINE_READ, engine=e.name) as ph:
        data = read_verified(stored)
        ph.bytes = len(data)
        ph.detail["sha256"] = "verified"
    worker = EngineWorker(e.name, stored, e.batching)
    where = (cfg.source, f"engines[{cfg.engines.index(e)}].batching")  # a setting its profiles refuse
    with timer.phase(Phases.ENGINE_DESERIALIZE, engine=e.name, backend=e.backend):
        try:
            worker.open(data, where=where)
        except BaseException:
            worker.close()
            raise
    workers[e.name] = worker
    return {"name": e.name, "backend": e.backend, "engine": str(stored.path),
            "bytes": stored.bytes, "key": stored.key.as_dict(), "pid": os.getpid()}
