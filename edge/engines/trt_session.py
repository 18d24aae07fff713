"""A TensorRT engine served on GPU 0, on the thread that constructs it.

Construction (on the engine's worker thread): CUDA initialized through the driver API, the
primary context retained and made current, the plan deserialized (a version-compatible plan that
embeds the lean runtime runs host code: allowed only when its bytes match the store's sha256),
I/O checked (an I/O dtype NumPy/KServe cannot carry — BF16, FP8, INT4, FP4 —, a shape tensor, or
a data-dependent output shape is refused here by name, not at the first request), one execution
context, one stream, and per tensor one device + pinned host buffer sized to the largest shape
any profile allows. A request then only picks the profile (`profile_for`, the same rule as
validation), sets shapes (checked), queues copy in, run, copy out on the stream and waits for
it; a batch of requests (`infer_rows`) is the same with more rows, each request's staged at its
offset in the pinned buffer. Every TensorRT call goes through `_trt`, the one place its exceptions become an EngineError
naming the engine. `close()` tears down in reverse and runs every step even when one fails:
stream drained, context, engine, runtime, buffers, stream, primary context. A load that fails
tears down only once the failure's traceback no longer holds the engine (its frames' locals are
cleared first), so the engine is destroyed before the context is released.

A sticky CUDA error (edge.device.cuda.ContextLost: the process's context is lost) makes the
session refuse all further work without a CUDA call, and its close() leaves the GPU objects to
the process's exit: freeing them would be CUDA work on a lost context.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge.device.cuda import ContextLost, CudaApi, PinnedBuffer, PrimaryContext, cuda_api
from edge.engines.store import StoredEngine
from edge.engines.tensors import KSERVE_DTYPES, TensorSpec, profile_for
from edge.errors import JETPACK_TRT, EngineError, GpuContextLost, MissingDependency

__all__ = ["TrtSession", "import_trt_runtime", "lean_library"]

log = logging.getLogger("edge")


def import_trt_runtime() -> Any:
    """`tensorrt`, else the lean runtime `tensorrt_lean` (version-compatible engines only); the
    same order as edge.device.identity.tensorrt_version, which puts that module's version in the key."""
    try:
        import tensorrt as trt
    except ImportError:
        try:
            import tensorrt_lean as trt
        except ImportError:
            raise MissingDependency("tensorrt", "trt-dgpu", f"serving TensorRT engines ({JETPACK_TRT})") from None
    return trt


def _run_all(steps: list[Callable[[], Any]]) -> None:
    """Every step, even after one fails; then the first failure."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


class TrtSession:
    platform = "tensorrt_plan"

    def __init__(self, stored: StoredEngine, data: bytes, api: CudaApi | None = None, trt: Any = None) -> None:
        self._where = str(stored.path)
        self._api = api or cuda_api()
        self._buffers: dict[str, PinnedBuffer] = {}
        self._stream: Any = None
        self._primary = PrimaryContext(self._api)  # cuInit + device: nothing held yet
        self._tensorrt = trt or import_trt_runtime()
        self.lost: str | None = None  # the sticky CUDA error this session's context was lost to
        try:
            self._primary.retain()
            self._primary.make_current()
            self._thread = threading.get_ident()
            self._open(stored, data)
        except BaseException as exc:
            # The traceback's frames still hold the engine (_io_specs' locals): cleared, so that
            # dropping the session's references really destroys it before the context goes.
            traceback.clear_frames(exc.__traceback__)
            try:
                self.close()
            except Exception as why:  # the load's own error is the one to report
                log.warning("%s: teardown after a failed load failed too: %s", self._where, why)
            raise

    def _trt(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A TensorRT call; what it raises (pybind11: RuntimeError, TypeError, ...) is an EngineError."""
        try:
            return fn(*args)
        except Exception as exc:
            raise EngineError(f"{self._where}: TensorRT {what} failed: {exc}") from None

    def _open(self, stored: StoredEngine, data: bytes) -> None:
        trt = self._tensorrt
        version = getattr(trt, "__version__", "")
        self._runtime = self._trt("Runtime", trt.Runtime, trt.Logger(trt.Logger.WARNING))
        if stored.meta.get("build", {}).get("flags", {}).get("exclude_lean_runtime"):
            self._runtime = self._lean_runtime(version)
        if self._host_code(stored, data):
            self._trt("engine_host_code_allowed", setattr, self._runtime, "engine_host_code_allowed", True)
        self._engine = self._trt("deserialize_cuda_engine", self._runtime.deserialize_cuda_engine, data)
        if self._engine is None:
            raise EngineError(f"{self._where}: TensorRT {version} could not deserialize the engine "
                              "(built for another TensorRT or GPU? TensorRT's log above says why)")
        self.inputs, self.outputs = self._io_specs()
        self.profiles: list[dict[str, dict[str, list[int]]]] = stored.meta.get("build", {}).get("profiles", [])
        count = self._trt("num_optimization_profiles", getattr, self._engine, "num_optimization_profiles")
        if len(self.profiles) != count:
            raise EngineError(f"{self._where}: the manifest lists {len(self.profiles)} profiles, the engine has {count}")
        self._context = self._trt("create_execution_context", self._engine.create_execution_context)
        if self._context is None:
            raise EngineError(f"{self._where}: TensorRT could not create an execution context "
                              "(out of GPU memory?)")
        flags = self._api.driver.CUstream_flags.CU_STREAM_NON_BLOCKING  # no implicit sync with stream 0
        self._stream = self._api.call("cuStreamCreate", flags)
        self._profile = -1
        self._allocate()

    def _lean_runtime(self, version: str) -> Any:
        """A version-compatible plan built with exclude_lean_runtime carries no runtime of its
        own: it runs on the lean runtime of the TensorRT that built it (IRuntime.load_runtime),
        which is this one, since such plans are keyed to their exact version (edge.engines.key)."""
        path = lean_library(version)
        lean = self._trt(f"load_runtime({path})", self._runtime.load_runtime, path)
        if lean is None:
            raise EngineError(f"{self._where}: the plan was built with exclude_lean_runtime and needs TensorRT "
                              f"{version}'s lean runtime library, which could not be loaded from {path} "
                              "(install TensorRT's lean runtime, or rebuild without exclude_lean_runtime)")
        return lean

    def _host_code(self, stored: StoredEngine, data: bytes) -> bool:
        """A version-compatible plan with the lean runtime inside runs that runtime's host code:
        TensorRT wants `engine_host_code_allowed`, given only to bytes the store's sha256 vouches for."""
        flags = stored.meta.get("build", {}).get("flags", {})
        if not stored.key.version_compatible or flags.get("exclude_lean_runtime"):
            return False
        if hashlib.sha256(data).hexdigest() != stored.sha256:
            raise EngineError(f"{self._where}: a version-compatible engine runs host code, and these bytes "
                              "do not match the store's sha256: not deserialized")
        return True

    def _io_specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs and outputs; an unsupported dtype or a shape tensor is refused by name."""
        trt, engine = self._tensorrt, self._engine
        carried = {np.dtype(v) for v in KSERVE_DTYPES.values()}
        inputs, outputs = [], []
        for i in range(self._trt("num_io_tensors", getattr, engine, "num_io_tensors")):
            name = self._trt("get_tensor_name", engine.get_tensor_name, i)
            trt_dtype = self._trt("get_tensor_dtype", engine.get_tensor_dtype, name)
            try:
                dtype = np.dtype(trt.nptype(trt_dtype))
            except (TypeError, KeyError):  # nptype raises for BF16, FP8, INT4, FP4
                dtype = None
            if dtype is None or dtype not in carried:
                raise EngineError(f"{self._where}: tensor {name!r} is {trt_dtype}, which edge cannot carry over "
                                  f"KServe (supported: {sorted(KSERVE_DTYPES)}); cast it in the ONNX at the "
                                  "graph's edge and rebuild")
            if self._trt("is_shape_inference_io", engine.is_shape_inference_io, name):
                raise EngineError(f"{self._where}: tensor {name!r} is a shape tensor (its values set shapes, "
                                  "and TensorRT reads it from host memory), which edge does not serve: make "
                                  "it a constant or an ordinary input in the ONNX and rebuild")
            shape = [int(d) for d in self._trt("get_tensor_shape", engine.get_tensor_shape, name)]
            mode = self._trt("get_tensor_mode", engine.get_tensor_mode, name)
            (inputs if mode == trt.TensorIOMode.INPUT else outputs).append(TensorSpec(name, dtype, shape))
        return inputs, outputs

    def _use_profile(self, idx: int) -> None:
        if idx != self._profile:  # the real binding raises RuntimeError on a refusal
            self._trt(f"set_optimization_profile_async({idx})", self._context.set_optimization_profile_async,
                      idx, int(self._stream))
            self._profile = idx

    def _set_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            if not self._trt("set_input_shape", self._context.set_input_shape, name, tuple(shape)):
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
                shape = shapes.get(spec.name) or tuple(self._trt("get_tensor_shape", self._context.get_tensor_shape,
                                                                 spec.name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"{self._where}: output {spec.name!r} has a data-dependent shape "
                                      f"{list(shape)} (needs an output allocator, which edge does not "
                                      "support): give the model static or input-derived output shapes")
                nbytes = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
                need[spec.name] = max(need.get(spec.name, 0), nbytes)
        for name, nbytes in need.items():
            self._buffers[name] = PinnedBuffer(self._api, nbytes)
            if not self._trt("set_tensor_address", self._context.set_tensor_address, name,
                             self._buffers[name].device):
                raise EngineError(f"{self._where}: TensorRT refused the device address of tensor {name!r}")

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._guarded({n: [a] for n, a in feeds.items()})

    def infer_rows(self, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Requests stacked along dim 0 (the batcher's, edge.engines.dynamic_batching: the same dims after
        the first) straight into the pinned input buffers, so the batch costs one host-to-device
        copy per input and one execution, with no concatenated array between; the outputs are the
        batch's (the batcher splits them by rows)."""
        return self._guarded({n: [p[n] for p in parts] for n in parts[0]})

    def _guarded(self, stacks: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
        if self.lost:  # nothing more goes to the GPU
            raise GpuContextLost(f"{self._where}: the CUDA context was lost ({self.lost}): no more GPU work")
        try:
            return self._infer(stacks)
        except ContextLost as exc:
            self.lost = str(exc)
            raise

    def _infer(self, stacks: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
        if threading.get_ident() != self._thread:  # a new thread has no current context yet
            self._primary.make_current()
            self._thread = threading.get_ident()
        shapes = {n: arrs[0].shape if len(arrs) == 1 else (sum(len(a) for a in arrs), *arrs[0].shape[1:])
                  for n, arrs in stacks.items()}
        idx = profile_for(self.profiles, shapes)
        if idx is None:
            raise EngineError(f"{self._where}: no optimization profile holds these shapes")
        self._use_profile(idx)
        self._set_shapes(shapes)  # a batch is more rows within the profile's min/max
        api, stream = self._api, self._stream
        for spec in self.inputs:
            buf, arrs = self._buffers[spec.name], stacks[spec.name]
            host = buf.host_view(shapes[spec.name], spec.dtype)
            if len(arrs) == 1:
                host[...] = arrs[0]
            else:
                ends = np.cumsum([len(a) for a in arrs])
                for a, end in zip(arrs, ends):
                    host[end - len(a):end] = a
            api.copy_async(buf.device, buf.host, host.nbytes, True, stream)
        if not self._trt("execute_async_v3", self._context.execute_async_v3, int(stream)):
            api.call("cuStreamSynchronize", stream)  # a lost context says so here (ContextLost)
            raise EngineError(f"{self._where}: TensorRT execution failed (its log says why)")
        views = {}
        for spec in self.outputs:
            buf = self._buffers[spec.name]
            shape = tuple(self._trt("get_tensor_shape", self._context.get_tensor_shape, spec.name))
            views[spec.name] = buf.host_view(shape, spec.dtype)
            api.copy_async(buf.host, buf.device, views[spec.name].nbytes, False, stream)
        api.call("cuStreamSynchronize", stream)  # the copies out have landed only now
        return {n: v.copy() for n, v in views.items()}  # the pinned buffers are reused

    def close(self) -> None:
        """On the serving thread, in order, every step even if one fails: work drained, TensorRT
        objects, buffers, stream, then the primary context released. After a sticky error none of
        it: each step would be CUDA work on the lost context; the process's exit frees it all."""
        if self.lost:
            log.warning("%s: not torn down: the CUDA context was lost (%s); the process exit frees it",
                        self._where, self.lost)
            return
        api, stream = self._api, self._stream

        def drop_trt() -> None:
            for attr in ("_context", "_engine", "_runtime"):  # context before engine before runtime
                self.__dict__.pop(attr, None)

        def destroy_stream() -> None:
            self._stream = None
            if stream is not None:
                api.call("cuStreamDestroy", stream)

        buffers, self._buffers = list(self._buffers.values()), {}
        _run_all([(lambda: api.call("cuStreamSynchronize", stream)) if stream is not None else (lambda: None),
                  drop_trt, *[b.free for b in buffers], destroy_stream, self._primary.release])


def lean_library(version: str) -> str:
    """TensorRT's lean runtime library for IRuntime.load_runtime: beside the pip wheel's libraries
    (the `tensorrt_libs` or `tensorrt_lean_libs` package), else by its soname, which the dynamic
    linker finds where JetPack's and the tar/deb installs put libnvinfer."""
    name = f"libnvinfer_lean.so.{version.split('.')[0] or '10'}"
    for package in ("tensorrt_libs", "tensorrt_lean_libs"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    return name
