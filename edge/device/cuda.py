"""The CUDA boundary for engines: the driver API only, through cuda-python's driver bindings.

Why the driver API only: libcuda is the device's own driver, so what edge calls can never be
newer than what the device runs. cuda-python >= 12.9 carries a CUDA runtime of its own inside
`cuda.bindings.runtime` (12.9 whatever the driver); on a Jetson a runtime newer than the driver
is not supported (JetPack 6's driver is CUDA 12.6) and its first call fails with
cudaErrorInsufficientDriver. edge therefore never imports `cuda.bindings.runtime`/`cudart`. The
runtime TensorRT and ggml-cuda load themselves (JetPack's libcudart, or the nvidia-cuda-runtime
wheel beside a TensorRT wheel) is the device's business: `edge doctor` checks it is not newer
than the driver on a Jetson. pycuda would also do (a driver-API binding built against the
device's CUDA), but it is an sdist that needs the CUDA toolkit's headers to install.

Why the primary context: it is the context the CUDA runtime uses, so TensorRT (runtime API),
llama.cpp's ggml-cuda (runtime API) and edge share one context per GPU. A context is current per
thread: whoever calls into an engine first makes it current on its own thread
(`PrimaryContext.make_current`); the runtime API then uses it on that thread.

Every call goes through `CudaApi.call`, which turns cuda-python's `(CUresult, *values)` tuples
into values or an EngineError naming the call and the error, and a driver library that cannot be
loaded (cuda-python raises its own RuntimeError then) into one line naming the missing driver.
A failure is told by the CUresult alone: cuda-python 12.6.x returns the unfilled value beside
it (`(err, CUdevice())`), later versions `(err, None)`. An error the driver documents as leaving
the process's context unusable ("sticky": `STICKY_ERRORS`) is a `ContextLost`, which the service
turns into a clean exit for a restart. Tests pass a named double of the driver module
(tests/fakecuda.py). Nothing here imports cuda-python at module level.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

# The errors live in edge.errors' tree; imported here too, where callers have always found them.
from edge.errors import ContextLost, CudaError, DriverMissing, EngineError, MissingDependency

__all__ = ["CUINIT_HINTS", "CudaApi", "ContextLost", "CudaError", "DriverMissing", "PrimaryContext", "PinnedBuffer",
           "STICKY_ERRORS", "cuda_api", "driver_module", "first_work", "hint", "integrated_gpu"]

# CUresults after which "any further CUDA work will return the same error. To continue using
# CUDA, the process must be terminated and relaunched" (cuda.h's words for each; the ASSERT
# context "cannot be used anymore"; ECC and NVLink uncorrectable are hardware faults that take the
# context with them). tests/device/test_fakecuda.py checks this list against the installed
# module's own documentation of every CUresult.
STICKY_ERRORS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ASSERT", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_TENSOR_MEMORY_LEAK", "CUDA_ERROR_CONTAINED", "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    "CUDA_ERROR_EXTERNAL_DEVICE",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_NVLINK_UNCORRECTABLE",
})

# What a failing cuInit most often means on the devices edge runs on: driver-API CUresult names,
# each one in every cuda-python the `trt` extra admits (tests/device/test_fakecuda.py checks).
CUINIT_HINTS = {
    "CUDA_ERROR_NOT_SUPPORTED": "on JetPack 6 cuInit needs the GPU's render node /dev/dri/renderD*: "
                                "under edge.service DeviceAllow= must allow it (`edge doctor` checks)",
    "CUDA_ERROR_NO_DEVICE": "no GPU is visible: CUDA_VISIBLE_DEVICES (in the environment or the unit's "
                            "Environment=) may hide it (unset it, or name an existing GPU), or a device "
                            "node is missing or not allowed by the unit's DeviceAllow=: /dev/nvidia* "
                            "(dGPU, JetPack 7), /dev/nvmap and /dev/nvgpu/igpu0/* (JetPack 6), "
                            "/dev/nvhost-* (JetPack 5) (`edge doctor` checks)",
    "CUDA_ERROR_UNKNOWN": "on a dGPU /dev/nvidia-uvm may be missing: run `nvidia-modprobe -u -c=0` "
                          "(edge-nvidia-uvm.service does it before edge.service starts)",
    "CUDA_ERROR_OPERATING_SYSTEM": "the driver's kernel module refused the process: check the device "
                                   "nodes' permissions and the unit's DeviceAllow=",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "the kernel driver and libcuda are different versions (a "
                                         "half-upgraded driver): reboot, or reinstall one driver version",
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE": "a forward-compatibility libcuda (the cuda-compat package, "
                                                 "e.g. on LD_LIBRARY_PATH) was loaded for a GPU it does not "
                                                 "support: use the driver's own libcuda",
}


def hint(error_name: str) -> str:
    """What to check for a CUresult name, or ""."""
    return CUINIT_HINTS.get(error_name, "")


def _error(call: str, name: str) -> CudaError:
    why = hint(name) if call in ("cuInit", "cuDeviceGet") else ""
    return (ContextLost if name in STICKY_ERRORS else CudaError)(call, name, why)


def driver_module() -> Any:
    """cuda-python's driver module: `cuda.bindings.driver` (12.6.1 and later), or `cuda.cuda` (12.6.0)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError:
            raise MissingDependency("cuda-python", "trt", "serving TensorRT engines (the CUDA context "
                                    "and buffers)") from None
    return driver


class CudaApi:
    """cuda-python's driver module, with every call edge makes checked."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._ok = driver.CUresult.CUDA_SUCCESS

    def call(self, name: str, *args: Any) -> Any:
        """driver.<name>(*args): its value (a tuple for several, None for none), or an EngineError."""
        try:
            err, *values = getattr(self.driver, name)(*args)
        except RuntimeError as exc:  # cuda-pathfinder's DynamicLibNotFoundError, or "Failed to dlopen"
            raise DriverMissing(str(exc)) from None
        if err != self._ok:  # its values are then None (>= 12.8) or unfilled (12.6.x): unused
            raise _error(name, str(getattr(err, "name", err)))
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def malloc(self, nbytes: int) -> int:
        return int(self.call("cuMemAlloc", max(nbytes, 1)))

    def malloc_host(self, nbytes: int) -> int:
        return int(self.call("cuMemAllocHost", max(nbytes, 1)))

    def copy_async(self, dst: int, src: int, nbytes: int, to_device: bool, stream: Any) -> None:
        """Queued on `stream`: the bytes are there only after the stream is synchronized."""
        self.call("cuMemcpyHtoDAsync" if to_device else "cuMemcpyDtoHAsync", dst, src, nbytes, stream)


def cuda_api() -> CudaApi:
    return CudaApi(driver_module())


def integrated_gpu(driver: Any = None) -> bool | None:
    """Whether GPU 0 shares the CPU's DRAM, as the driver says (CU_DEVICE_ATTRIBUTE_INTEGRATED);
    None when it cannot say: no cuda-python, no driver library, no usable GPU."""
    try:
        api = CudaApi(driver or driver_module())
        api.call("cuInit", 0)
        dev = api.call("cuDeviceGet", 0)
        return bool(api.call("cuDeviceGetAttribute",
                             api.driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED, dev))
    except (EngineError, MissingDependency):  # no driver library, a failing call; no cuda-python
        return None


def first_work(api: CudaApi) -> None:
    """The first CUDA work a service does, in miniature: GPU 0's primary context retained and made
    current, one byte allocated and freed, the context released. Where cuInit passes and this
    fails, a device node the context or the allocator needs is closed (JetPack 6: /dev/nvmap)."""
    ctx = PrimaryContext(api)
    ctx.retain()
    try:
        ctx.make_current()
        api.call("cuMemFree", api.malloc(1))
    finally:
        ctx.release()


class PrimaryContext:
    """The primary context of one GPU: `retain()` once (at load), made current on every thread
    that runs engine work, released once (`release()`, the last step of a teardown). cuInit and
    the device lookup hold nothing, so a failure there leaves nothing to release."""

    def __init__(self, api: CudaApi, device: int = 0) -> None:
        self.api = api
        api.call("cuInit", 0)
        self._dev = api.call("cuDeviceGet", device)
        self._ctx: Any = None

    def retain(self) -> None:
        self._ctx = self.api.call("cuDevicePrimaryCtxRetain", self._dev)

    def make_current(self) -> None:
        self.api.call("cuCtxSetCurrent", self._ctx)

    def release(self) -> None:
        if self._ctx is not None:
            self._ctx = None
            self.api.call("cuDevicePrimaryCtxRelease", self._dev)


class PinnedBuffer:
    """A device buffer and a page-locked host buffer of the same size, allocated once (for the
    largest shape any profile allows), so a request never allocates and copies run async."""

    def __init__(self, api: CudaApi, nbytes: int) -> None:
        self.api, self.nbytes = api, nbytes
        self.device = api.malloc(nbytes)
        try:
            self.host = api.malloc_host(nbytes)
        except EngineError:
            api.call("cuMemFree", self.device)
            raise

    def host_view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if n > self.nbytes:
            raise EngineError(f"{n} bytes do not fit the {self.nbytes}-byte buffer sized for the profile maximum")
        raw = (ctypes.c_ubyte * max(n, 1)).from_address(self.host)
        return np.frombuffer(raw, dtype=dtype, count=n // np.dtype(dtype).itemsize).reshape(shape)

    def free(self) -> None:
        try:
            self.api.call("cuMemFreeHost", self.host)
        finally:
            self.api.call("cuMemFree", self.device)
