"""The CUDA test double against the real cuda-python (installed by the dev extra), and edge
against the real cuda-python as it behaves on a machine without an NVIDIA driver."""

from __future__ import annotations

import ctypes
import inspect
import os
from pathlib import Path

import pytest

from edge.device.cuda import (CUINIT_HINTS, STICKY_ERRORS, ContextLost, CudaApi, CudaError, DriverMissing,
                              PrimaryContext, cuda_api, driver_module, first_work, integrated_gpu)
from edge.engines.key import EngineKey
from edge.engines.store import StoredEngine
from edge.engines.trt_session import TrtSession
from edge.errors import GpuContextLost
from fakecuda import BINDINGS, H100, VALUES, FakeDriver, FakeGpu, FakeTensorRT, real

FAKE_CALLS = sorted(n for n in vars(FakeDriver) if n.startswith("cu"))


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _current(gpu: FakeGpu) -> CudaApi:
    """The driver API over `gpu`, with GPU 0's primary context retained and current here."""
    api = CudaApi(gpu.driver)
    ctx = PrimaryContext(api)
    ctx.retain()
    ctx.make_current()
    return api


def _has_driver() -> bool:
    try:
        return real.cuDriverGetVersion()[0] == real.CUresult.CUDA_SUCCESS
    except RuntimeError:
        return False


def test_every_call_the_fake_offers_is_the_real_ones_with_the_same_parameters() -> None:
    fake = FakeDriver(FakeGpu())
    assert FAKE_CALLS == sorted(VALUES)  # each call knows how many values it returns
    for name in FAKE_CALLS:
        assert callable(getattr(real, name, None)), f"{name} is not in cuda.bindings.driver"
        assert _params(getattr(fake, name)) == _params(getattr(real, name)), name


def test_the_fakes_enums_and_handles_are_the_real_modules() -> None:
    for name in ("CUresult", "CUdevice_attribute", "CUstream_flags", "CUdevice", "CUcontext", "CUstream",
                 "CUdeviceptr"):
        assert getattr(FakeDriver, name) is getattr(real, name)


def test_edge_calls_only_what_the_real_driver_module_has() -> None:
    """Every driver call named in edge/ exists in the real module; no runtime (cudart) call is made."""
    import re

    src = "\n".join(p.read_text() for p in (Path(__file__).parents[2] / "edge").rglob("*.py"))
    called = set(re.findall(r'"(cu[A-Z][A-Za-z0-9_]+)"', src))
    assert {"cuInit", "cuMemAlloc", "cuMemcpyHtoDAsync", "cuStreamSynchronize"} <= called
    assert not [n for n in called if not hasattr(real, n)]
    assert set(called) <= set(FAKE_CALLS)  # and the double offers each one
    imports = re.findall(r"^\s*(?:from|import) (cuda\S*)(?: import (.+))?$", src, re.M)
    assert imports and not [i for i in imports if "runtime" in i[0] + i[1] or "cudart" in i[1]], imports


def test_failures_have_the_shape_of_each_binding() -> None:
    """cuda-python 12.6.x returns the unfilled value objects beside a failing CUresult (its
    driver.pyx: `return (CUresult(err), device)` whatever err is); 12.8 and later return None."""
    R = real.CUresult
    old, new = FakeGpu(binding="12.6").driver, FakeGpu(binding="12.9").driver
    err, dev = old.cuDeviceGet(0)  # before cuInit
    assert err == R.CUDA_ERROR_NOT_INITIALIZED and isinstance(dev, real.CUdevice) and int(dev) == 0
    assert new.cuDeviceGet(0) == (R.CUDA_ERROR_NOT_INITIALIZED, None)
    for d in (old, new):
        assert d.cuDriverGetVersion()[0] == R.CUDA_SUCCESS  # needs no cuInit
        d.cuInit(0)
    assert old.cuMemGetInfo() == (R.CUDA_ERROR_INVALID_CONTEXT, 0, 0)  # no current context
    assert new.cuMemGetInfo() == (R.CUDA_ERROR_INVALID_CONTEXT, None, None)
    assert old.cuDeviceGetName(8, real.CUdevice(1)) == (R.CUDA_SUCCESS, b"Orin\0   ")
    err, ptr = old.cuMemAlloc(16)
    assert err == R.CUDA_ERROR_INVALID_CONTEXT and isinstance(ptr, real.CUdeviceptr) and int(ptr) == 0
    _, ctx = old.cuDevicePrimaryCtxRetain(old.cuDeviceGet(0)[1])
    old.cuCtxSetCurrent(ctx)
    err, ptr = old.cuMemAlloc(16)
    assert err == R.CUDA_SUCCESS and isinstance(ptr, real.CUdeviceptr) and int(ptr) != 0


@pytest.mark.parametrize("binding", BINDINGS)
def test_edge_reads_a_failure_by_its_cuda_result_whatever_comes_beside_it(binding: str) -> None:
    api = CudaApi(FakeGpu(binding=binding, fail={"cuDeviceGet": "CUDA_ERROR_NO_DEVICE"}).driver)
    api.call("cuInit", 0)
    with pytest.raises(CudaError) as info:  # not a CUdevice(0) taken for GPU 0
        api.call("cuDeviceGet", 0)
    assert info.value.name == "CUDA_ERROR_NO_DEVICE" and "CUDA_VISIBLE_DEVICES" in str(info.value)
    assert integrated_gpu(FakeGpu(binding=binding, fail={"cuDeviceGetAttribute": "CUDA_ERROR_INVALID_VALUE"})
                          .driver) is None  # unknown: an unfilled 0 is not "discrete"


def test_frees_synchronize_and_destroy_need_a_current_context() -> None:
    gpu = FakeGpu()
    api = _current(gpu)
    stream, ptr, host = api.call("cuStreamCreate", 0), api.malloc(4), api.malloc_host(4)
    api.call("cuCtxSetCurrent", None)
    for call, arg in (("cuMemFree", ptr), ("cuMemFreeHost", host), ("cuStreamSynchronize", stream),
                      ("cuStreamDestroy", stream)):
        with pytest.raises(CudaError, match=f"{call} failed: CUDA_ERROR_INVALID_CONTEXT"):
            api.call(call, arg)


# The sticky CUresults and the first cuda-python whose driver module has each, as checked in
# throwaway venvs of every release the `trt` extra admits (>=12.6,<13): 12.6.0 (cuda.cuda),
# 12.6.2.post1, 12.8.0, 12.9.10. HARDWARE: sticky by what they are (ECC, NVLink uncorrectable: the
# fault takes the context with it), which no docstring says; the rest by cuda.h's words.
STICKY_SINCE = {name: (12, 6) for name in (
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    "CUDA_ERROR_EXTERNAL_DEVICE", "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_NVLINK_UNCORRECTABLE")}
STICKY_SINCE.update({"CUDA_ERROR_TENSOR_MEMORY_LEAK": (12, 8), "CUDA_ERROR_CONTAINED": (12, 8)})
HARDWARE = {"CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_NVLINK_UNCORRECTABLE"}


def _bindings_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("cuda-bindings", "cuda-python"):  # cuda-python 12.6.0 is one package
        try:
            return tuple(int(x) for x in version(dist).split(".")[:2])  # type: ignore[return-value]
        except PackageNotFoundError:
            continue
    raise AssertionError("no cuda-python installed")


def test_the_sticky_errors_are_the_ones_the_driver_documents_as_such() -> None:
    """Each sticky name is a CUresult of the installed bindings exactly from the release the table
    says; where the bindings document each CUresult (12.9.x carries cuda.h's text per member;
    12.6 to 12.8 give every member the enum's own "Error codes"), the results documented as
    needing a relaunched process, or a context that "cannot be used anymore", are the table's."""
    import re

    have = {e.name for e in real.CUresult}
    installed = _bindings_version()
    assert set(STICKY_SINCE) == STICKY_ERRORS
    assert {n for n, since in STICKY_SINCE.items() if since <= installed} <= have, installed
    assert not {n for n, since in STICKY_SINCE.items() if since > installed} & have, "the table's releases are wrong"
    docs = {e.name: " ".join((e.__doc__ or "").split()) for e in real.CUresult}
    if len(set(docs.values())) > 1:  # per-member documentation
        lost = {n for n, doc in docs.items() if re.search(r"must be terminated and relaunched|cannot be used anymore", doc)}
        assert lost == (STICKY_ERRORS - HARDWARE) & have, lost ^ ((STICKY_ERRORS - HARDWARE) & have)
    exc = CudaApi(FakeGpu(fail={"cuInit": "CUDA_ERROR_LAUNCH_FAILED"}).driver)
    with pytest.raises(ContextLost) as info:
        exc.call("cuInit", 0)
    assert isinstance(info.value, GpuContextLost) and info.value.exit_code == 70  # restartable


def test_every_cuinit_hint_names_a_driver_api_result() -> None:
    """A hint for a name the driver never returns would never be shown (CUDA_ERROR_INSUFFICIENT_DRIVER
    is no CUresult in any binding: the runtime API's cudaErrorInsufficientDriver is). The names are
    in 12.6.0's CUresult already, so in every release the extra admits."""
    assert set(CUINIT_HINTS) <= {e.name for e in real.CUresult}, set(CUINIT_HINTS) - {e.name for e in real.CUresult}
    assert "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" in CUINIT_HINTS


def test_a_faulting_kernel_loses_the_context_for_every_later_call() -> None:
    gpu = FakeGpu(fault=("CUDA_ERROR_ILLEGAL_ADDRESS", 666.0))
    api = _current(gpu)
    stream = api.call("cuStreamCreate", 0)

    def kernel() -> None:
        from fakecuda import KernelFault

        raise KernelFault("CUDA_ERROR_ILLEGAL_ADDRESS")

    gpu.enqueue(stream, kernel)
    with pytest.raises(ContextLost, match="cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        api.call("cuStreamSynchronize", stream)
    with pytest.raises(ContextLost, match="cuMemAlloc failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        api.malloc(4)  # sticky: the same error for any work on the context
    assert api.call("cuDriverGetVersion") == 12060  # the driver itself still answers


def test_first_work_retains_allocates_and_gives_everything_back() -> None:
    gpu = FakeGpu()
    api = CudaApi(gpu.driver)
    api.call("cuInit", 0)
    first_work(api)
    assert [c for c in gpu.order() if c != "set_current"] == ["retain", "malloc", "free", "release"]
    assert gpu.retained == 0 and not gpu.memory
    closed = FakeGpu(fail={"cuMemAlloc": "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(CudaError, match="cuMemAlloc failed"):
        first_work(CudaApi(closed.driver))
    assert closed.retained == 0  # released after the failure too


def test_integrated_comes_from_the_driver() -> None:
    assert integrated_gpu(FakeGpu().driver) is True
    assert integrated_gpu(FakeGpu(H100).driver) is False
    assert integrated_gpu(FakeGpu(fail={"cuInit": "CUDA_ERROR_NO_DEVICE"}).driver) is None


def test_copies_happen_at_synchronize_not_when_queued() -> None:
    gpu = FakeGpu()
    api = _current(gpu)
    stream = api.call("cuStreamCreate", 0)
    src, dst = api.malloc_host(4), api.malloc(4)
    ctypes.memmove(src, b"abcd", 4)
    api.copy_async(dst, src, 4, True, stream)
    assert ctypes.string_at(dst, 4) == b"\0" * 4  # queued, not done
    api.call("cuStreamSynchronize", stream)
    assert ctypes.string_at(dst, 4) == b"abcd"


def test_the_query_functions_answer_like_the_driver() -> None:
    gpu = FakeGpu()
    api = CudaApi(gpu.driver)
    api.call("cuInit", 0)
    dev = api.call("cuDeviceGet", 0)
    name = api.call("cuDeviceGetName", 256, dev)
    assert len(name) == 256 and name.split(b"\0")[0] == b"Orin"
    attr = real.CUdevice_attribute
    assert api.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_INTEGRATED, dev) == 1
    assert api.call("cuDriverGetVersion") == 12060


# -- the real cuda-python, here: no NVIDIA driver --------------------------------------------

no_driver = pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver")


@no_driver
def test_a_missing_driver_is_one_line_naming_it() -> None:
    api = cuda_api()
    assert api.driver is driver_module() and api.driver.__name__ in ("cuda.bindings.driver", "cuda.cuda")
    with pytest.raises(DriverMissing) as info:
        api.call("cuInit", 0)
    msg = str(info.value)
    assert "libcuda.so.1 cannot be loaded" in msg and "\n" not in msg
    assert info.value.exit_code == 65  # the unit does not restart into the same missing library


@no_driver
def test_a_trt_session_without_a_driver_fails_before_holding_anything(tmp_path: Path) -> None:
    key = EngineKey(model="m", model_sha256="ab" * 32, backend="tensorrt", target="sm_87", precision="fp16")
    stored = StoredEngine(key, tmp_path / "m.engine", "00", 0, {})
    gpu = FakeGpu()  # TensorRT's double: never reached
    with pytest.raises(DriverMissing, match="libcuda.so.1"):
        TrtSession(stored, b"{}", trt=FakeTensorRT(gpu))
    assert not gpu.log


def test_a_cuda_error_names_the_call_and_the_error() -> None:
    with pytest.raises(CudaError) as info:  # cuInit's error with what it most often means
        CudaApi(FakeGpu(fail={"cuInit": "CUDA_ERROR_NOT_SUPPORTED"}).driver).call("cuInit", 0)
    assert "renderD" in str(info.value) and info.value.exit_code == 65 and info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
    assert str(CudaError("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY")) == \
        "CUDA cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"


def test_the_driver_module_never_brings_the_bundled_runtime() -> None:
    """cuda-python >= 12.9 links a CUDA runtime into cuda.bindings.runtime: importing the driver
    module must not load it (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys\nfrom edge.device.cuda import cuda_api\ncuda_api()\n"
            "print(sorted(m for m in sys.modules if 'runtime' in m and m.startswith('cuda')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@no_driver
def test_edge_serve_with_a_tensorrt_engine_and_no_driver_exits_with_one_line(tmp_path: Path) -> None:
    """The real CLI, the real cuda-python, no NVIDIA driver: one line naming the missing driver
    library, exit 65 (the unit does not restart), no traceback; `edge device --json` and `edge
    doctor` say why there is no GPU and where each CUDA number came from."""
    import json
    import subprocess

    from kit import EDGE

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "state"}"\n'
                   f'cache_dir = "{tmp_path / "cache"}"\n[[engines]]\nname = "mlp"\nbackend = "tensorrt"\n'
                   f'recipe = "{root / "engines" / "mlp-demo.toml"}"\n')
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("edge: error:")]
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and "libcuda.so.1 cannot be loaded" in errors[0] and "install the NVIDIA driver" in errors[0]
    device = json.loads(subprocess.run([*EDGE, "device", "--json"], capture_output=True, text=True,
                                       timeout=60).stdout)
    assert "libcuda.so.1 cannot be loaded" in device["gpu_error"] and device["cuda_driver"] is None
    assert {"cuda_source", "cuda_runtimes", "unified_memory"} <= set(device)
    doc = subprocess.run([*EDGE, "doctor", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert doc.returncode == 1 and "CUDA driver - (cuDriverGetVersion)" in doc.stdout
    assert "[FAIL] engine mlp" in doc.stdout and "make the GPU usable first" in doc.stdout
