"""Engine sessions at serving time: deserialize a stored engine and run it.

`session_from_engine(stored, data)` picks the backend from the key: TensorRT
(edge/engines/trt_session.py: the primary CUDA context on the calling thread, cuda-python
buffers, `execute_async_v3`) or ONNX Runtime (a session over the prebuilt ORT-format model,
with graph optimization off because it was done at build time). Call it on the thread that will
serve the engine, and `close()` the session there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge.engines.store import StoredEngine
from edge.errors import EngineError, RequestError, require
from edge.kserve import kserve_datatype

__all__ = ["EngineSession", "TensorSpec", "check_feeds", "profile_for", "session_from_engine"]

Profiles = list[dict[str, dict[str, list[int]]]]  # per profile: input -> {"min", "opt", "max"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: Any  # numpy dtype
    shape: list[int]  # -1 for dynamic dims

    @property
    def datatype(self) -> str:
        return kserve_datatype(self.dtype)


class EngineSession(Protocol):
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    profiles: list[dict[str, dict[str, list[int]]]]
    platform: str

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def profile_for(profiles: Profiles, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The first optimization profile whose ranges hold every input's shape at once (profiles
    are chosen jointly, never per input); 0 for an engine without profiles; None if none fits."""
    if not profiles:
        return 0
    for idx, prof in enumerate(profiles):
        if all(len(shapes[n]) == len(r["min"]) and
               all(lo <= d <= hi for lo, d, hi in zip(r["min"], shapes[n], r["max"]))
               for n, r in prof.items() if n in shapes):
            return idx
    return None


def check_feeds(session: EngineSession, feeds: dict[str, np.ndarray]) -> None:
    """Names, dtypes and shapes within the engine's profile ranges, else a RequestError."""
    names = {t.name for t in session.inputs}
    for name in feeds:
        if name not in names:
            raise RequestError(f"unknown input {name!r}; inputs are {sorted(names)}", param="inputs")
    for spec in session.inputs:
        if spec.name not in feeds:
            raise RequestError(f"missing input {spec.name!r}", param="inputs")
        arr = feeds[spec.name]
        if np.dtype(arr.dtype) != np.dtype(spec.dtype):
            raise RequestError(f"input {spec.name!r} must be {spec.datatype}, found "
                               f"{TensorSpec(spec.name, arr.dtype, []).datatype}", param="inputs")
        if len(arr.shape) != len(spec.shape) or any(d not in (-1, a) for d, a in zip(spec.shape, arr.shape)):
            raise RequestError(f"input {spec.name!r} has shape {list(arr.shape)}, the engine takes "
                               f"{spec.shape} (-1: any size within its profile)", param="inputs")
    if profile_for(session.profiles, {n: a.shape for n, a in feeds.items()}) is None:
        shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in feeds.items())
        spans = "; ".join(f"profile {i}: " + ", ".join(f"{n} {r['min']}..{r['max']}" for n, r in p.items())
                          for i, p in enumerate(session.profiles))
        raise RequestError(f"inputs {shapes} are outside the engine's optimization profiles (one profile "
                           f"must hold all inputs: {spans})", param="inputs")


class OrtSession:
    platform = "onnxruntime_ort"

    def __init__(self, stored: StoredEngine, data: bytes) -> None:
        ort = require("onnxruntime", "ort", "serving ONNX Runtime engines")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done at build time
        so.add_session_config_entry("session.load_model_format", "ORT")
        try:
            self._sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise EngineError(f"{stored.path}: ONNX Runtime could not load the engine: {exc}") from None
        self.profiles = stored.meta.get("build", {}).get("profiles", [])
        to_np = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                 "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
                 "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}

        def spec(t: Any) -> TensorSpec:
            return TensorSpec(t.name, to_np[t.type], [d if isinstance(d, int) else -1 for d in t.shape])

        self.inputs = [spec(t) for t in self._sess.get_inputs()]
        self.outputs = [spec(t) for t in self._sess.get_outputs()]

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.outputs]
        return dict(zip(names, self._sess.run(names, feeds)))

    def close(self) -> None:
        self._sess = None




def session_from_engine(stored: StoredEngine, data: bytes) -> EngineSession:
    if stored.key.backend == "tensorrt":
        from edge.engines.trt_session import TrtSession

        return TrtSession(stored, data)
    return OrtSession(stored, data)
