"""The CUDA boundary for engines: GPU 0's primary context, a stream, device and pinned buffers.

Why the primary context: it is the one the CUDA runtime API uses, so TensorRT (runtime API),
llama.cpp's ggml-cuda (runtime API) and edge share one context per GPU instead of each creating
its own (pycuda.autoinit made a private context current on the importing thread only, so the
engine's worker thread had none). A context is current per thread: whoever calls into an engine
first makes the primary context current on its own thread (`PrimaryContext.make_current`).

Every call goes through cuda-python's driver and runtime modules, passed in, so tests give a
named double (tests/fakecuda.py) that holds the same per-thread rule. Nothing here imports
cuda-python at module level.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from edge.errors import EngineError, MissingDependency

__all__ = ["CudaApi", "PrimaryContext", "PinnedBuffer", "cuda_api"]


class CudaApi:
    """cuda-python's driver and runtime modules, with the calls edge makes checked."""

    def __init__(self, driver: Any, runtime: Any) -> None:
        self.driver, self.runtime = driver, runtime

    def check(self, result: Any, what: str) -> Any:
        """cuda-python returns (error, *values): raise on an error, return the value(s)."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if getattr(err, "value", err) != 0:
            raise EngineError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
        return values[0] if len(values) == 1 else tuple(values) or None

    def malloc(self, nbytes: int) -> int:
        return int(self.check(self.runtime.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    def malloc_host(self, nbytes: int) -> int:
        return int(self.check(self.runtime.cudaMallocHost(max(nbytes, 1)), "cudaMallocHost"))

    def copy_async(self, dst: int, src: int, nbytes: int, to_device: bool, stream: Any) -> None:
        kinds = self.runtime.cudaMemcpyKind
        kind = kinds.cudaMemcpyHostToDevice if to_device else kinds.cudaMemcpyDeviceToHost
        self.check(self.runtime.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def cuda_api() -> CudaApi:
    """The real modules: cuda.bindings (cuda-python >= 12.6), or the older cuda.cuda/cuda.cudart."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        try:
            from cuda import cuda as driver, cudart as runtime  # type: ignore[no-redef]
        except ImportError:
            raise MissingDependency("cuda-python", "trt", "serving TensorRT engines (the CUDA context "
                                    "and buffers)") from None
    return CudaApi(driver, runtime)


class PrimaryContext:
    """The primary context of one GPU, retained once (load) and released once (close), made
    current on every thread that runs engine work."""

    def __init__(self, api: CudaApi, device: int = 0) -> None:
        self.api, self.device = api, device
        api.check(api.driver.cuInit(0), "cuInit")
        self._dev = api.check(api.driver.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = api.check(api.driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._retained = True

    def make_current(self) -> None:
        self.api.check(self.api.driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        # the runtime API (TensorRT, ggml-cuda) picks the device per thread too
        self.api.check(self.api.runtime.cudaSetDevice(self.device), "cudaSetDevice")

    def release(self) -> None:
        """Last step of a teardown: after every buffer, stream and TensorRT object is gone."""
        if self._retained:
            self._retained = False
            self.api.check(self.api.driver.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")


class PinnedBuffer:
    """A device buffer and a page-locked host buffer of the same size, allocated once (for the
    largest shape any profile allows), so a request never allocates and copies run async."""

    def __init__(self, api: CudaApi, nbytes: int) -> None:
        self.api, self.nbytes = api, nbytes
        self.device = api.malloc(nbytes)
        try:
            self.host = api.malloc_host(nbytes)
        except EngineError:
            api.check(api.runtime.cudaFree(self.device), "cudaFree")
            raise

    def host_view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if n > self.nbytes:
            raise EngineError(f"{n} bytes do not fit the {self.nbytes}-byte buffer sized for the profile maximum")
        raw = (ctypes.c_ubyte * max(n, 1)).from_address(self.host)
        return np.frombuffer(raw, dtype=dtype, count=n // np.dtype(dtype).itemsize).reshape(shape)

    def free(self) -> None:
        self.api.check(self.api.runtime.cudaFreeHost(self.host), "cudaFreeHost")
        self.api.check(self.api.runtime.cudaFree(self.device), "cudaFree")
