"""Engine sessions at serving time: deserialize a stored engine and run it.

`session_from_engine(stored, data)` picks the backend from the key: TensorRT
(`Runtime.deserialize_cuda_engine`, an execution context, device buffers and a stream through
pycuda, `execute_async_v3`) or ONNX Runtime (a session over the prebuilt ORT-format model, with
graph optimization off because it was done at build time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge.engines.store import StoredEngine
from edge.errors import EngineError, MissingDependency, RequestError

__all__ = ["EngineSession", "TensorSpec", "session_from_engine", "KSERVE_DTYPES"]

# KServe v2 datatype <-> numpy
KSERVE_DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64,
                 "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: Any  # numpy dtype
    shape: list[int]  # -1 for dynamic dims

    @property
    def datatype(self) -> str:
        return next(k for k, v in KSERVE_DTYPES.items() if np.dtype(v) == np.dtype(self.dtype))


class EngineSession(Protocol):
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    profiles: list[dict[str, dict[str, list[int]]]]
    platform: str

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


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
        ranges = [p[spec.name] for p in session.profiles if spec.name in p]
        if ranges and not any(all(lo <= a <= hi for lo, a, hi in zip(r["min"], arr.shape, r["max"]))
                              for r in ranges):
            span = ", ".join(f"{r['min']}..{r['max']}" for r in ranges)
            raise RequestError(f"input {spec.name!r} shape {list(arr.shape)} is outside the engine's "
                               f"optimization profiles ({span})", param="inputs")


class OrtSession:
    platform = "onnxruntime_ort"

    def __init__(self, stored: StoredEngine, data: bytes) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise MissingDependency("onnxruntime", "ort", "serving ONNX Runtime engines") from None
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


class TrtSession:
    """TensorRT engine on GPU 0: one execution context that switches to the optimization profile
    holding each request's shapes; device buffers grow to the largest request seen."""

    platform = "tensorrt_plan"

    def __init__(self, stored: StoredEngine, data: bytes) -> None:
        trt = _import_trt_runtime()
        try:
            import pycuda.autoinit  # noqa: F401  (creates the CUDA context on GPU 0)
            import pycuda.driver as cuda
        except ImportError:
            raise MissingDependency("pycuda", "trt", "serving TensorRT engines") from None
        self._cuda = cuda
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(data)
        if self._engine is None:
            raise EngineError(f"{stored.path}: TensorRT could not deserialize the engine "
                              "(built for another TensorRT or GPU?)")
        self._context = self._engine.create_execution_context()
        self._stream = cuda.Stream()
        self.profiles = stored.meta.get("build", {}).get("profiles", [])
        self.inputs, self.outputs = [], []
        for i in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(i)
            spec = TensorSpec(name, np.dtype(trt.nptype(self._engine.get_tensor_dtype(name))),
                              list(self._engine.get_tensor_shape(name)))
            is_input = self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (self.inputs if is_input else self.outputs).append(spec)
        self._device: dict[str, Any] = {}
        self._capacity: dict[str, int] = {}
        self._profile = 0

    def _buffer(self, name: str, nbytes: int) -> Any:
        if self._capacity.get(name, -1) < nbytes:
            self._device[name] = self._cuda.mem_alloc(max(nbytes, 1))
            self._capacity[name] = nbytes
            self._context.set_tensor_address(name, int(self._device[name]))
        return self._device[name]

    def _select_profile(self, feeds: dict[str, np.ndarray]) -> None:
        """Switch the context to the first optimization profile whose ranges hold these shapes."""
        for idx, prof in enumerate(self.profiles):
            if all(all(lo <= d <= hi for lo, d, hi in zip(r["min"], feeds[n].shape, r["max"]))
                   for n, r in prof.items() if n in feeds):
                if idx != self._profile:
                    self._context.set_optimization_profile_async(idx, self._stream.handle)
                    self._profile = idx
                return

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cuda, ctx = self._cuda, self._context
        self._select_profile(feeds)
        for spec in self.inputs:
            arr = np.ascontiguousarray(feeds[spec.name])
            ctx.set_input_shape(spec.name, arr.shape)
            cuda.memcpy_htod_async(self._buffer(spec.name, arr.nbytes), arr, self._stream)
        results = {}
        for spec in self.outputs:
            shape = tuple(ctx.get_tensor_shape(spec.name))
            results[spec.name] = np.empty(shape, dtype=spec.dtype)
            self._buffer(spec.name, results[spec.name].nbytes)
        if not ctx.execute_async_v3(self._stream.handle):
            raise EngineError("TensorRT execution failed")
        for name, host in results.items():
            cuda.memcpy_dtoh_async(host, self._device[name], self._stream)
        self._stream.synchronize()
        return results


def _import_trt_runtime() -> Any:
    try:
        import tensorrt as trt
    except ImportError:
        try:
            import tensorrt_lean as trt  # the lean runtime deserializes version-compatible engines
        except ImportError:
            raise MissingDependency("tensorrt", "trt", "serving TensorRT engines") from None
    return trt


def session_from_engine(stored: StoredEngine, data: bytes) -> EngineSession:
    makers = {"tensorrt": TrtSession, "onnxruntime": OrtSession}
    return makers[stored.key.backend](stored, data)
