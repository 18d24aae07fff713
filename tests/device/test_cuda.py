"""TensorRT sessions on the serving thread, over the CUDA/TensorRT test doubles (tests/fakecuda.py):
the primary context current on the worker, buffers allocated once, copies waited for, teardown
order, refusals, and every failure leaving nothing held."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from edge.device.cuda import ContextLost, CudaApi
from edge.engines.key import EngineKey
from edge.lifecycle.engines import EngineWorker
from edge.engines.tensors import profile_for
from edge.engines.store import StoredEngine
from edge.engines.trt_session import TrtSession
from edge.errors import EngineError, GpuContextLost
from fakecuda import FakeGpu, FakeTensorRT

PROFILES = [{"x": {"min": [1, 4], "opt": [2, 4], "max": [8, 4]}},
            {"x": {"min": [9, 4], "opt": [16, 4], "max": [32, 4]}}]


def _engine(tmp_path: Path, vc: bool = False, sha256: str | None = None, **spec) -> tuple[StoredEngine, bytes]:
    body = {"inputs": {"x": "FLOAT"}, "outputs": {"y": "FLOAT"},
            "profiles": [{"x": [1, 8]}, {"x": [9, 32]}], **spec}
    data = json.dumps(body).encode()
    key = EngineKey(model="m", model_sha256="ab" * 32, backend="tensorrt", target="sm_87", precision="fp16",
                    version_compatible=vc)
    stored = StoredEngine(key, tmp_path / "m.engine", sha256 or hashlib.sha256(data).hexdigest(), len(data),
                          {"build": {"profiles": PROFILES}})
    return stored, data


def _maker(cuda: FakeGpu):
    return functools.partial(TrtSession, api=CudaApi(cuda.driver), trt=FakeTensorRT(cuda))


def _held(cuda: FakeGpu) -> tuple[int, int, int]:
    """(retained contexts, allocations, streams) still held."""
    return cuda.retained, len(cuda.memory), len(cuda.streams)


def _serve(worker: EngineWorker, x: np.ndarray) -> np.ndarray:
    return asyncio.run(worker.call(worker.session.infer, {"x": x}))["y"]


def test_inference_runs_on_the_worker_thread_in_the_primary_context(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    worker = EngineWorker("m", stored)
    worker.open(data, make=_maker(cuda))
    try:
        worker_thread = cuda.calls("set_current")[0]
        assert worker_thread != threading.get_ident()  # made current on the worker, not here
        assert cuda.current() is None  # this (main) thread never got a context
        assert set(cuda.calls("malloc")) == {worker_thread} and cuda.retained == 1
        for batch in (1, 8, 9, 32):  # both profiles
            x = np.arange(batch * 4, dtype=np.float32).reshape(batch, 4)
            np.testing.assert_array_equal(_serve(worker, x), 2 * x + 1)
        # sized once for the profile maximum: no request allocates
        assert len(cuda.calls("malloc")) == 2 and len(cuda.calls("malloc_host")) == 2
    finally:
        worker.close()


def test_teardown_on_the_worker_in_order(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    worker = EngineWorker("m", stored)
    worker.open(data, make=_maker(cuda))
    worker_thread = cuda.calls("set_current")[0]
    start = len(cuda.log)
    worker.close()
    calls = [c for c, _ in cuda.log[start:]]
    assert calls[0] == "sync" and calls[-1] == "release" and calls[-2] == "stream_destroy"
    assert calls.count("free") == 2 and calls.count("free_host") == 2
    assert {t for _, t in cuda.log[start:]} == {worker_thread}
    assert _held(cuda) == (0, 0, 0)


def test_a_session_used_from_a_new_thread_makes_the_context_current_there(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    out: dict[str, np.ndarray] = {}
    t = threading.Thread(target=lambda: out.update(session.infer({"x": np.ones((2, 4), np.float32)})))
    t.start()
    t.join()
    np.testing.assert_array_equal(out["y"], np.full((2, 4), 3, np.float32))
    assert cuda.calls("set_current")[-1] == t.ident
    session.close()


@pytest.mark.parametrize("spec, words", [
    ({"inputs": {"x": "BF16"}}, "tensor 'x' is BF16, which edge cannot carry"),
    ({"outputs": {"y": "FP8"}}, "tensor 'y' is FP8"),
    ({"inputs": {"x": "FLOAT", "dims": "INT64"}, "shape_tensors": ["dims"]}, "tensor 'dims' is a shape tensor"),
    ({"data_dependent": True}, "output 'y' has a data-dependent shape"),
    ({"no_context": True}, "could not create an execution context"),
    ({"profiles": [{"x": [1, 8]}]}, "the manifest lists 2 profiles, the engine has 1"),
    ({"host_code": True}, "could not deserialize"),  # a plan with the lean runtime inside, key not vc
])
def test_refused_at_load_with_everything_released(tmp_path: Path, spec, words) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path, **spec)
    with pytest.raises(EngineError, match=words) as info:
        _maker(cuda)(stored, data)
    assert str(stored.path) in str(info.value)  # names the engine
    assert _held(cuda) == (0, 0, 0)


@pytest.mark.parametrize("call, error, words", [
    ("cuInit", "CUDA_ERROR_NOT_SUPPORTED", r"cuInit failed: CUDA_ERROR_NOT_SUPPORTED \(on JetPack 6 .*renderD"),
    ("cuInit", "CUDA_ERROR_NO_DEVICE", "DeviceAllow="),
    ("cuCtxSetCurrent", "CUDA_ERROR_INVALID_CONTEXT", "cuCtxSetCurrent failed"),  # retained: released
    ("cuMemAllocHost", "CUDA_ERROR_OUT_OF_MEMORY", "cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY"),
    ("cuStreamCreate", "CUDA_ERROR_OUT_OF_MEMORY", "cuStreamCreate failed"),
])
def test_a_failing_cuda_call_is_one_error_and_releases_everything(tmp_path: Path, call, error, words) -> None:
    cuda = FakeGpu(fail={call: error})
    stored, data = _engine(tmp_path)
    with pytest.raises(EngineError, match=words):
        _maker(cuda)(stored, data)
    assert _held(cuda) == (0, 0, 0)


def test_a_refused_profile_is_an_engine_error_naming_the_engine(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    session.profiles = [*PROFILES, {"x": {"min": [33, 4], "opt": [33, 4], "max": [40, 4]}}]  # not in the plan
    with pytest.raises(EngineError, match=r"m.engine: TensorRT set_optimization_profile_async\(2\) failed: "
                                          "Error in set optimization profile async"):
        session.infer({"x": np.ones((33, 4), np.float32)})
    session.close()
    assert _held(cuda) == (0, 0, 0)


def test_version_compatible_plan_runs_host_code_only_when_the_store_vouches_for_it(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path, vc=True, host_code=True)
    session = _maker(cuda)(stored, data)
    np.testing.assert_array_equal(session.infer({"x": np.ones((2, 4), np.float32)})["y"], np.full((2, 4), 3.0))
    session.close()
    trt = FakeTensorRT(cuda)
    bad, data = _engine(tmp_path, vc=True, sha256="00" * 32, host_code=True)
    with pytest.raises(EngineError, match="do not match the store's sha256"):
        TrtSession(bad, data, api=CudaApi(cuda.driver), trt=trt)
    assert trt.runtimes[-1].engine_host_code_allowed is False
    assert _held(cuda) == (0, 0, 0)


def test_a_plan_without_its_lean_runtime_runs_on_the_lean_runtime_loaded_for_it(tmp_path: Path) -> None:
    """version_compatible + exclude_lean_runtime: the plan carries no runtime, so it is deserialized
    by IRuntime.load_runtime(<this TensorRT's libnvinfer_lean>), never with host code allowed."""
    cuda = FakeGpu()
    trt = FakeTensorRT(cuda)
    excluded, data = _engine(tmp_path, excluded_lean=True)
    excluded.meta["build"]["flags"] = {"version_compatible": True, "exclude_lean_runtime": True}
    session = TrtSession(excluded, data, api=CudaApi(cuda.driver), trt=trt)
    np.testing.assert_array_equal(session.infer({"x": np.ones((1, 4), np.float32)})["y"], np.full((1, 4), 3.0))
    session.close()
    lean = trt.runtimes[-1]
    assert lean.lean is not None and lean.lean.endswith("libnvinfer_lean.so.10")  # TensorRT 10.3's
    assert lean.engine_host_code_allowed is False and _held(cuda) == (0, 0, 0)
    plain, data = _engine(tmp_path, excluded_lean=True)  # the flag lost: the default runtime cannot
    with pytest.raises(EngineError, match="could not deserialize"):
        TrtSession(plain, data, api=CudaApi(cuda.driver), trt=trt)


def test_a_sticky_error_loses_the_session_and_nothing_more_goes_to_the_gpu(tmp_path: Path) -> None:
    cuda = FakeGpu(fault=("CUDA_ERROR_ILLEGAL_ADDRESS", 666.0))
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    np.testing.assert_array_equal(session.infer({"x": np.ones((2, 4), np.float32)})["y"], np.full((2, 4), 3.0))
    with pytest.raises(ContextLost, match="cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        session.infer({"x": np.full((2, 4), 666.0, np.float32)})
    calls = len(cuda.log)
    with pytest.raises(GpuContextLost, match="CUDA context was lost .*CUDA_ERROR_ILLEGAL_ADDRESS"):
        session.infer({"x": np.ones((2, 4), np.float32)})
    session.close()  # no teardown on a lost context: the process exit frees it
    assert len(cuda.log) == calls and cuda.retained == 1


def test_a_failed_execution_on_a_lost_context_says_the_context_is_lost(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    cuda.lost = "CUDA_ERROR_LAUNCH_FAILED"  # an earlier fault, e.g. of llama.cpp on the same context
    with pytest.raises(ContextLost, match="CUDA_ERROR_LAUNCH_FAILED"):
        session.infer({"x": np.ones((2, 4), np.float32)})
    assert session.lost


def test_a_load_refused_at_the_io_check_destroys_the_engine_before_releasing_the_context(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path, inputs={"x": "BF16"})
    with pytest.raises(EngineError, match="BF16"):
        _maker(cuda)(stored, data)
    order = cuda.order()
    assert "engine_freed" in order and order.index("engine_freed") < order.index("release"), order
    assert "engine_freed_without_context" not in order


def test_outputs_are_read_only_after_the_stream_is_synchronized(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    start = len(cuda.log)
    out = session.infer({"x": np.full((3, 4), 5, np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((3, 4), 11, np.float32))
    assert [c for c, _ in cuda.log[start:]] == ["sync"]  # one wait per request, after the queued work
    session.close()


def test_teardown_runs_every_step_when_one_fails(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, data = _engine(tmp_path)
    session = _maker(cuda)(stored, data)
    cuda.fail["cuMemFreeHost"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(EngineError, match="cuMemFreeHost failed"):
        session.close()
    assert cuda.retained == 0 and not cuda.streams  # stream destroyed and context released all the same
    assert len(cuda.calls("free")) == 2


def test_unreadable_plan_and_a_refused_shape(tmp_path: Path) -> None:
    cuda = FakeGpu()
    stored, _ = _engine(tmp_path)
    with pytest.raises(EngineError, match="could not deserialize"):
        _maker(cuda)(stored, b"not a plan")
    session = _maker(cuda)(stored, _engine(tmp_path)[1])
    with pytest.raises(EngineError, match="no optimization profile holds"):
        session.infer({"x": np.ones((33, 4), np.float32)})
    session.profiles = [{"x": {"min": [1, 4], "opt": [1, 4], "max": [64, 4]}}, *PROFILES[1:]]
    with pytest.raises(EngineError, match=r"refused shape \[33, 4\] for input 'x'"):
        session.infer({"x": np.ones((33, 4), np.float32)})  # set_input_shape returned False
    session.close()


def test_profile_choice_holds_all_inputs_jointly() -> None:
    profiles = [{"a": {"min": [1], "max": [4]}, "b": {"min": [1], "max": [4]}},
                {"a": {"min": [5], "max": [8]}, "b": {"min": [1], "max": [8]}}]
    assert profile_for(profiles, {"a": (2,), "b": (3,)}) == 0
    assert profile_for(profiles, {"a": (6,), "b": (3,)}) == 1  # b fits both; a decides
    assert profile_for(profiles, {"a": (2,), "b": (6,)}) is None  # each fits some profile, none both
    assert profile_for([], {"a": (2,)}) == 0
