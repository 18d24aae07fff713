"""A TensorRT engine served on GPU 0, on the thread that constructs it.

Construction (on the engine's worker thread): the primary context made current, the plan
deserialized, I/O checked (an I/O dtype NumPy/KServe cannot carry — BF16, FP8, INT4, FP4 — or a
data-dependent output shape is refused here, not at the first request), one execution context,
one stream, and per tensor one device + pinned host buffer sized to the largest shape any
profile allows. A request then only picks the profile (`profile_for`, the same rule as
validation), sets shapes (checked), copies in, runs, copies out. `close()` tears down in
reverse: stream drained, context, engine, runtime, buffers, stream, primary context.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from edge.engines.cuda import CudaApi, PinnedBuffer, PrimaryContext, cuda_api
from edge.engines.tensors import KSERVE_DTYPES, TensorSpec, profile_for
from edge.engines.store import StoredEngine
from edge.errors import JETPACK_TRT, EngineError, MissingDependency

__all__ = ["TrtSession", "import_trt_runtime", "io_specs"]


def import_trt_runtime() -> Any:
    try:
        import tensorrt as trt
    except ImportError:
        try:
            import tensorrt_lean as trt  # the lean runtime: version-compatible engines only
        except ImportError:
            raise MissingDependency("tensorrt", "trt-dgpu", f"serving TensorRT engines ({JETPACK_TRT})") from None
    return trt


def io_specs(trt: Any, engine: Any, where: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of a deserialized engine; an unsupported dtype is refused by name."""
    carried = {np.dtype(v) for v in KSERVE_DTYPES.values()}
    inputs, outputs = [], []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        trt_dtype = engine.get_tensor_dtype(name)
        try:
            dtype = np.dtype(trt.nptype(trt_dtype))
        except (TypeError, KeyError):  # nptype raises for BF16, FP8, INT4, FP4
            dtype = None
        if dtype is None or dtype not in carried:
            raise EngineError(f"{where}: tensor {name!r} is {trt_dtype}, which edge cannot carry over "
                              f"KServe (supported: {sorted(KSERVE_DTYPES)}); cast it in the ONNX at the "
                              "graph's edge and rebuild")
        spec = TensorSpec(name, dtype, [int(d) for d in engine.get_tensor_shape(name)])
        (inputs if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outputs).append(spec)
    return inputs, outputs


class TrtSession:
    platform = "tensorrt_plan"

    def __init__(self, stored: StoredEngine, data: bytes, api: CudaApi | None = None, trt: Any = None) -> None:
        self._where = str(stored.path)
        self._trt = trt or import_trt_runtime()
        self._api = api or cuda_api()
        self._primary = PrimaryContext(self._api)
        self._primary.make_current()
        self._thread = threading.get_ident()
        self._buffers: dict[str, PinnedBuffer] = {}
        self._stream: Any = None
        try:
            self._open(stored, data)
        except BaseException:
            self.close()
            raise

    def _open(self, stored: StoredEngine, data: bytes) -> None:
        trt = self._trt
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(data)
        if self._engine is None:
            raise EngineError(f"{self._where}: TensorRT {getattr(trt, '__version__', '')} could not "
                              "deserialize the engine (built for another TensorRT or GPU?)")
        self.inputs, self.outputs = io_specs(trt, self._engine, self._where)
        self.profiles: list[dict[str, dict[str, list[int]]]] = stored.meta.get("build", {}).get("profiles", [])
        if len(self.profiles) != self._engine.num_optimization_profiles:
            raise EngineError(f"{self._where}: the manifest lists {len(self.profiles)} profiles, the engine "
                              f"has {self._engine.num_optimization_profiles}")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise EngineError(f"{self._where}: TensorRT could not create an execution context "
                              "(out of GPU memory?)")
        self._stream = self._api.check(self._api.runtime.cudaStreamCreate(), "cudaStreamCreate")
        self._profile = -1
        self._allocate()

    def _use_profile(self, idx: int) -> None:
        if idx != self._profile:
            if not self._context.set_optimization_profile_async(idx, int(self._stream)):
                raise EngineError(f"{self._where}: TensorRT refused optimization profile {idx}")
            self._profile = idx

    def _set_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            if not self._context.set_input_shape(name, tuple(shape)):
                raise EngineError(f"{self._where}: TensorRT refused shape {list(shape)} for input "
                                  f"{name!r} in profile {self._profile}")

    def _allocate(self) -> None:
        """Per tensor, the largest size over every profile's max shapes; an output whose shape
        is still unknown once all input shapes are set depends on the data: refused."""
        need: dict[str, int] = {}
        for idx, prof in enumerate(self.profiles or [{}]):
            self._use_profile(idx)
            shapes = {t.name: tuple(prof[t.name]["max"]) if t.name in prof else tuple(t.shape) for t in self.inputs}
            self._set_shapes(shapes)
            for spec in self.inputs + self.outputs:
                shape = shapes.get(spec.name) or tuple(self._context.get_tensor_shape(spec.name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"{self._where}: output {spec.name!r} has a data-dependent shape "
                                      f"{list(shape)} (needs an output allocator, which edge does not "
                                      "support): give the model static or input-derived output shapes")
                nbytes = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
                need[spec.name] = max(need.get(spec.name, 0), nbytes)
        for name, nbytes in need.items():
            self._buffers[name] = PinnedBuffer(self._api, nbytes)
            self._context.set_tensor_address(name, self._buffers[name].device)

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if threading.get_ident() != self._thread:  # a new thread has no current context yet
            self._primary.make_current()
            self._thread = threading.get_ident()
        idx = profile_for(self.profiles, {n: a.shape for n, a in feeds.items()})
        if idx is None:
            raise EngineError(f"{self._where}: no optimization profile holds these shapes")
        self._use_profile(idx)
        self._set_shapes({n: a.shape for n, a in feeds.items()})
        api, stream = self._api, self._stream
        for spec in self.inputs:
            buf = self._buffers[spec.name]
            host = buf.host_view(feeds[spec.name].shape, spec.dtype)
            host[...] = feeds[spec.name]
            api.copy_async(buf.device, buf.host, host.nbytes, True, stream)
        if not self._context.execute_async_v3(int(stream)):
            raise EngineError(f"{self._where}: TensorRT execution failed (its log says why)")
        views = {}
        for spec in self.outputs:
            buf = self._buffers[spec.name]
            views[spec.name] = buf.host_view(tuple(self._context.get_tensor_shape(spec.name)), spec.dtype)
            api.copy_async(buf.host, buf.device, views[spec.name].nbytes, False, stream)
        api.check(api.runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return {n: v.copy() for n, v in views.items()}  # the pinned buffers are reused

    def close(self) -> None:
        """On the serving thread, in order: work drained, TensorRT objects, buffers, stream,
        then the primary context released."""
        api = self._api
        if self._stream is not None:
            api.check(api.runtime.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        for attr in ("_context", "_engine", "_runtime"):  # context before engine before runtime
            if hasattr(self, attr):
                delattr(self, attr)
        for buf in self._buffers.values():
            buf.free()
        self._buffers.clear()
        if self._stream is not None:
            api.check(api.runtime.cudaStreamDestroy(self._stream), "cudaStreamDestroy")
            self._stream = None
        self._primary.release()
