"""A TensorRT double on the real CUDA driver, for a GPU host without TensorRT (scripts/gpu-check).

fakecuda.FakeTensorRT's engine format and API (the double at the TensorRT boundary), with its
one kernel, y = 2x + 1, run on the real GPU: PTX that the driver JIT-compiles (cuModuleLoadData)
and launched on the stream edge gives the execution context (cuLaunchKernel), reading and writing
the device buffers edge allocated. An input equal to POISON makes the kernel store through a
null pointer, which the GPU reports as CUDA_ERROR_ILLEGAL_ADDRESS, a sticky error, at edge's next
synchronize: so everything from the driver down is real, TensorRT alone is not.
"""

from __future__ import annotations

import ctypes
from typing import Any

from edge.device.cuda import CudaApi, driver_module
from fakecuda import FakeContext, FakeEngine, FakeRuntime, FakeTensorRT

__all__ = ["POISON", "PTX", "PtxTensorRT", "RealGpu"]

POISON = 666.0
THREADS = 128
# y[i] = 2 x[i] + 1 for i < n; x[i] == 666.0 (0x44268000) stores to address 0 instead
PTX = b"""
.version 7.0
.target sm_52
.address_size 64

.visible .entry affine(.param .u64 x_ptr, .param .u64 y_ptr, .param .u32 n)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [x_ptr];
    ld.param.u64 %rd2, [y_ptr];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r5, 4;
    add.s64 %rd6, %rd3, %rd5;
    ld.global.f32 %f1, [%rd6];
    setp.eq.f32 %p2, %f1, 0f44268000;
    @%p2 bra FAULT;
    fma.rn.f32 %f2, %f1, 0f40000000, 0f3F800000;
    add.s64 %rd7, %rd4, %rd5;
    st.global.f32 [%rd7], %f2;
    bra DONE;
FAULT:
    mov.u64 %rd7, 0;
    st.global.f32 [%rd7], %f1;
DONE:
    ret;
}
\x00"""


class RealGpu:
    """The surface the TensorRT double asks of a GPU (fakecuda.FakeGpu's), from the real driver."""

    fault = None  # the kernel's own POISON check faults, on the GPU
    lost = False  # the driver says so: execute's launch fails, edge's synchronize raises
    retained = 1

    def __init__(self, api: CudaApi) -> None:
        self.api = api
        self._function: Any = None
        self._image = ctypes.create_string_buffer(PTX)  # kept alive while the module is loaded

    def current(self) -> Any:
        ctx = self.api.call("cuCtxGetCurrent")
        return ctx if ctx is not None and int(ctx) else None

    def note(self, what: str) -> None:
        pass

    def function(self) -> Any:
        """The kernel, JIT-compiled once in the current (primary) context."""
        if self._function is None:
            module = self.api.call("cuModuleLoadData", ctypes.addressof(self._image))
            self._function = self.api.call("cuModuleGetFunction", module, b"affine")
        return self._function

    def launch(self, stream: int, x: int, y: int, n: int) -> None:
        args = [ctypes.c_uint64(x), ctypes.c_uint64(y), ctypes.c_uint32(n)]
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        blocks = (n + THREADS - 1) // THREADS
        self.api.call("cuLaunchKernel", self.function(), blocks, 1, 1, THREADS, 1, 1, 0, stream,
                      ctypes.addressof(params), 0)


class PtxContext(FakeContext):
    def execute_async_v3(self, stream_handle: int) -> bool:
        gpu: RealGpu = self.engine.trt.gpu
        (x_name,), (y_name,) = self.engine.spec["inputs"], self.engine.spec["outputs"]
        n = 1
        for d in self.shapes[x_name]:
            n *= int(d)
        try:
            gpu.launch(stream_handle, self.addresses[x_name], self.addresses[y_name], n)
        except Exception:  # real TensorRT: an error in its log, False
            return False
        return True


class PtxEngine(FakeEngine):
    def create_execution_context(self) -> Any:
        if self.trt.gpu.current() is None:
            return None
        ctx = PtxContext(self)
        self.trt.contexts.append(ctx)
        return ctx


class PtxRuntime(FakeRuntime):
    def deserialize_cuda_engine(self, serialized_engine: bytes) -> Any:
        engine = super().deserialize_cuda_engine(serialized_engine)
        return None if engine is None else PtxEngine(self.trt, engine.spec)


class PtxTensorRT(FakeTensorRT):
    """`tensorrt` for `edge serve` on a real GPU: FakeTensorRT's engines, run by the PTX kernel."""

    def __init__(self, driver: Any = None) -> None:
        super().__init__(RealGpu(CudaApi(driver or driver_module())))  # type: ignore[arg-type]

    def Runtime(self, logger: Any) -> PtxRuntime:
        rt = PtxRuntime(self, logger)
        self.runtimes.append(rt)
        return rt
