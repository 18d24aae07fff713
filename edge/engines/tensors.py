"""What every engine backend and the KServe protocol share: tensor specs, the wire datatypes,
optimization-profile choice and request validation.

It sits below the backends (runtime.py, trt_session.py) and kserve.py, so none of them imports
another for these names: numpy only, no backend, no HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge.errors import RequestError

__all__ = ["KSERVE_DTYPES", "EngineSession", "Profiles", "TensorSpec", "check_feeds", "kserve_datatype",
           "profile_for"]

Profiles = list[dict[str, dict[str, list[int]]]]  # per profile: input -> {"min", "opt", "max"}

# KServe v2 datatype <-> numpy (BF16/FP8 have no NumPy type: engines with them are refused at load)
KSERVE_DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64,
                 "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


def kserve_datatype(dtype: object) -> str:
    want = np.dtype(dtype)  # type: ignore[call-overload]
    for name, np_type in KSERVE_DTYPES.items():
        if np.dtype(np_type) == want:
            return name
    raise ValueError(f"{want} has no KServe v2 datatype")


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
    profiles: Profiles
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
