"""Test doubles at the CUDA/TensorRT boundary, for CPU-only machines.

`FakeCudaDriver` / `FakeCudaRuntime` stand in for cuda-python's driver and runtime modules and
keep CUDA's one rule that matters here: a context is current per thread, and memory calls on a
thread without one fail (the failure pycuda.autoinit caused on the worker thread). Device memory
is host memory, so copies really move bytes. `FakeTensorRT` stands in for the `tensorrt` module:
an engine described by JSON whose one layer computes y = 2x + 1, with per-profile ranges.
The real path (cuda-python, TensorRT) runs in the GPU-gated tests and scripts/gpu-check.
"""

from __future__ import annotations

import ctypes
import enum
import json
import threading
import types
from typing import Any

import numpy as np


class FakeResult(enum.IntEnum):
    SUCCESS = 0
    ERROR_INVALID_CONTEXT = 201


OK, NO_CONTEXT = FakeResult.SUCCESS, FakeResult.ERROR_INVALID_CONTEXT


class FakeCuda:
    """Driver and runtime sharing one state, as the real libraries share the primary context."""

    def __init__(self) -> None:
        self.tls = threading.local()
        self.retained = 0
        self.log: list[tuple[str, int]] = []  # (call, thread ident)
        self.memory: dict[int, Any] = {}
        self.driver = FakeCudaDriver(self)
        self.runtime = FakeCudaRuntime(self)

    def note(self, call: str) -> None:
        self.log.append((call, threading.get_ident()))

    def current(self) -> Any:
        return getattr(self.tls, "ctx", None)

    def calls(self, name: str) -> list[int]:
        return [t for c, t in self.log if c == name]


class FakeCudaDriver:
    CUresult = FakeResult

    def __init__(self, cuda: FakeCuda) -> None:
        self.c = cuda

    def cuInit(self, flags: int) -> tuple:
        return (OK,)

    def cuDeviceGet(self, i: int) -> tuple:
        return OK, i

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        self.c.retained += 1
        self.c.note("retain")
        return OK, ("primary", dev)

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:
        self.c.retained -= 1
        self.c.note("release")
        return (OK,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple:
        self.c.tls.ctx = ctx
        self.c.note("set_current")
        return (OK,)


class FakeCudaRuntime:
    cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice="h2d", cudaMemcpyDeviceToHost="d2h")

    def __init__(self, cuda: FakeCuda) -> None:
        self.c = cuda

    def cudaSetDevice(self, d: int) -> tuple:
        return (OK,)

    def _alloc(self, n: int, what: str) -> tuple:
        if self.c.current() is None:
            return NO_CONTEXT, 0
        buf = ctypes.create_string_buffer(n)
        self.c.memory[ctypes.addressof(buf)] = buf
        self.c.note(what)
        return OK, ctypes.addressof(buf)

    def cudaMalloc(self, n: int) -> tuple:
        return self._alloc(n, "malloc")

    def cudaMallocHost(self, n: int) -> tuple:
        return self._alloc(n, "malloc_host")

    def _free(self, p: int, what: str) -> tuple:
        del self.c.memory[p]
        self.c.note(what)
        return (OK,)

    def cudaFree(self, p: int) -> tuple:
        return self._free(p, "free")

    def cudaFreeHost(self, p: int) -> tuple:
        return self._free(p, "free_host")

    def cudaStreamCreate(self) -> tuple:
        if self.c.current() is None:
            return NO_CONTEXT, 0
        self.c.note("stream_create")
        return OK, 7

    def cudaStreamDestroy(self, s: int) -> tuple:
        self.c.note("stream_destroy")
        return (OK,)

    def cudaStreamSynchronize(self, s: int) -> tuple:
        self.c.note("sync")
        return (OK,)

    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind: str, stream: int) -> tuple:
        if self.c.current() is None:
            return (NO_CONTEXT,)
        ctypes.memmove(dst, src, n)
        return (OK,)


class FakeTensorRT:
    """The `tensorrt` module's surface TrtSession uses. An engine's bytes are JSON:
    {"inputs": {name: dtype}, "outputs": {name: dtype}, "profiles": [{name: [min, max]}],
    "data_dependent": bool}; every tensor is [-1, 4]-shaped and y = 2x + 1."""

    __version__ = "10.3.0.30"
    TensorIOMode = types.SimpleNamespace(INPUT="input", OUTPUT="output")

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda s, level=2: None})
        self.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=self._engine)
        self.contexts: list[FakeContext] = []

    @staticmethod
    def nptype(dt: str) -> Any:
        table = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32}
        if dt not in table:
            raise TypeError(f"Could not resolve TensorRT datatype to an equivalent numpy datatype. ({dt})")
        return table[dt]

    def _engine(self, data: bytes) -> Any:
        try:
            return FakeEngine(self, json.loads(data))
        except ValueError:
            return None


class FakeEngine:
    def __init__(self, trt: FakeTensorRT, spec: dict[str, Any]) -> None:
        self.trt, self.spec = trt, spec
        self.names = [*spec["inputs"], *spec["outputs"]]
        self.num_io_tensors = len(self.names)
        self.num_optimization_profiles = len(spec["profiles"])

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_dtype(self, name: str) -> str:
        return {**self.spec["inputs"], **self.spec["outputs"]}[name]

    def get_tensor_shape(self, name: str) -> list[int]:
        return [-1, 4]

    def get_tensor_mode(self, name: str) -> str:
        return "input" if name in self.spec["inputs"] else "output"

    def create_execution_context(self) -> Any:
        if self.trt.cuda.current() is None or self.spec.get("no_context"):
            return None  # real TensorRT: no usable CUDA context / out of memory
        ctx = FakeContext(self)
        self.trt.contexts.append(ctx)
        return ctx


class FakeContext:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

    def set_optimization_profile_async(self, idx: int, stream: int) -> bool:
        if not 0 <= idx < self.engine.num_optimization_profiles:
            return False
        self.profile = idx
        return True

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        lo, hi = self.engine.spec["profiles"][self.profile][name]
        if len(shape) != 2 or shape[1] != 4 or not lo <= shape[0] <= hi:
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple:
        if name in self.engine.spec["inputs"]:
            return self.shapes[name]
        if self.engine.spec.get("data_dependent"):
            return (-1, 4)
        return next(iter(self.shapes.values()))

    def set_tensor_address(self, name: str, addr: int) -> None:
        self.addresses[name] = addr

    def execute_async_v3(self, stream: int) -> bool:
        if self.engine.trt.cuda.current() is None:
            return False
        (x_name,), (y_name,) = self.engine.spec["inputs"], self.engine.spec["outputs"]
        n = int(np.prod(self.shapes[x_name]))
        x = np.frombuffer((ctypes.c_float * n).from_address(self.addresses[x_name]), np.float32)
        y = np.frombuffer((ctypes.c_float * n).from_address(self.addresses[y_name]), np.float32)
        y[:] = 2 * x + 1
        return True
