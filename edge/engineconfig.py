"""The `[[engines]]` tables of the config: a TensorRT or ONNX Runtime engine served from the
store, and how its KServe requests are batched. Checked here, read by `edge.config.load`;
names are checked by the rule models share (`check_name`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.errors import ConfigError
from edge.toml import value_range as _range

__all__ = ["BatchingConfig", "EngineConfig", "check_engines", "check_name"]


@dataclass(frozen=True)
class BatchingConfig:
    """An engine's KServe requests batched as Triton's dynamic batcher does (edge.engines.dynamic_batching,
    which checks these against the engine's profiles): enabled ("auto": where it has a batch dim),
    the oldest request's longest wait for company (0: a batch is what queued while the engine was
    busy), the most rows (0: what the profiles take), rows that run without waiting (0: the most)."""

    enabled: bool | str = field(default="auto", metadata={"choices": ("auto", True, False)})  # "auto": where the engine has a batch dimension
    max_queue_delay_us: int = field(default=0, metadata=_range(0, 1_000_000))  # the oldest request's longest wait for company (0: what queued while the engine was busy)
    max_batch_size: int = field(default=0, metadata=_range(0, 1 << 16))  # the most rows in one execution (0: what the profiles take)
    preferred_batch_size: int = field(default=0, metadata=_range(0, 1 << 16))  # rows that run without waiting (0: the most)


@dataclass(frozen=True)
class EngineConfig:
    """A TensorRT or ONNX Runtime engine served from the store, found by this device's key."""

    name: str  # the engine's name in the API (/v2/models/{name}) and on /metrics
    backend: str = "tensorrt"  # tensorrt | onnxruntime
    recipe: str | None = None  # its ONNX's sha256, precision and profiles name the engine
    onnx_sha256: str | None = None  # instead of recipe, on devices that hold no ONNX
    precision: str | None = None  # with onnx_sha256: fp32 | fp16 | int8
    profile: str = ""  # with onnx_sha256: the key's profile label (recipe profile names joined by "+"; "": one default profile)
    store: str | None = None  # default: <cache_dir>/engines
    warmup: bool = True  # run every profile's min/opt/max shapes before READY
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # its KServe requests batched (edge.engines.dynamic_batching)


def check_name(name: str, source: str, key: str) -> None:
    # Names are path segments of the API (/v2/models/{name}) and labels of the metrics.
    if not name or name != name.strip() or any(c in name for c in "/?#%\"\\") or not name.isprintable():
        raise ConfigError(source, key, f"expected a name without spaces around it, '/', '?', '#', '%', "
                          f"quotes or backslashes, found {name!r}")


def check_engines(engines: list[EngineConfig], source: str, base_dir: Path | None) -> list[EngineConfig]:
    """The engine tables checked, their recipe and store paths made absolute (relative to the
    config file: an OTA version dir holds both)."""
    resolved, seen = [], set()
    for i, e in enumerate(engines):
        where = f"engines[{i}]"
        check_name(e.name, source, f"{where}.name")
        if e.backend not in ("tensorrt", "onnxruntime"):
            raise ConfigError(source, f"{where}.backend", f"expected 'tensorrt' or 'onnxruntime', found {e.backend!r}")
        if e.name in seen:
            raise ConfigError(source, f"{where}.name", f"duplicate engine name {e.name!r}")
        seen.add(e.name)
        if (e.recipe is None) == (e.onnx_sha256 is None):
            raise ConfigError(source, where, "expected exactly one of recipe or onnx_sha256")
        if e.onnx_sha256 is not None and e.precision not in ("fp32", "fp16", "int8"):
            raise ConfigError(source, f"{where}.precision", "with onnx_sha256, expected fp32, fp16 or int8, "
                              f"found {e.precision!r}")
        recipe, store = e.recipe, e.store
        if base_dir is not None:  # relative to the config file: an OTA version dir holds both
            recipe = str((base_dir / recipe).resolve()) if recipe and not os.path.isabs(recipe) else recipe
            store = str((base_dir / store).resolve()) if store and not os.path.isabs(store) else store
        resolved.append(dataclasses.replace(e, recipe=recipe, store=store))
    return resolved
