"""Which stored engine each configured engine is on this device: the store of an engine entry
and the lookup by this device's key. Below the loader (edge.lifecycle.engines), so that `edge doctor`,
`edge engines gc` and the reload's memory guard ask it without the engine workers."""

from __future__ import annotations

from edge.config import Config, EngineConfig, cache_dir
from edge.device.identity import DeviceInfo
from edge.engines.key import key_for
from edge.engines.store import EngineStore, StoredEngine
from edge.errors import EdgeError

__all__ = ["configured_engines", "store_for"]


def store_for(cfg: Config, e: EngineConfig) -> EngineStore:
    return EngineStore(e.store or cache_dir(cfg) / "engines")


def configured_engines(cfg: Config, device: DeviceInfo) -> list[tuple[EngineConfig, StoredEngine | EdgeError]]:
    """Each engine of the config with the stored engine this device would load, or why none:
    what `edge engines gc` keeps, what `edge doctor` checks and what the memory guard counts."""
    found: list[tuple[EngineConfig, StoredEngine | EdgeError]] = []
    for e in cfg.engines:
        try:
            found.append((e, store_for(cfg, e).find(key_for(e, device))))
        except EdgeError as exc:
            found.append((e, exc))
    return found
