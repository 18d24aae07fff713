"""A sticky CUDA error (the driver's "the process must be relaunched" errors) ends the service
cleanly for a restart, instead of answering 500 forever: through a real `edge serve` on the CUDA
and TensorRT doubles (kit.gpudouble), and the HTTP side in process."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx

from edge.errors import EX_SOFTWARE
from edge.serve.app import ServiceState, build_app
from kit import PidOne, post
from kit.gpudouble import engine_in_store, serve_on_fake_gpu

SHA = hashlib.sha256(b"the demo engine's onnx").hexdigest()
POISON = 666.0  # the double's kernel faults on this input value


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nhost = "127.0.0.1"\nport = 0\n[paths]\nstate_dir = "{tmp_path / "state"}"\n'
                   f'cache_dir = "{tmp_path / "cache"}"\n[[engines]]\nname = "mlp"\nbackend = "tensorrt"\n'
                   f'onnx_sha256 = "{SHA}"\nprecision = "fp16"\nstore = "{tmp_path / "store"}"\n')
    return cfg


def _infer(x: list[float]) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x}]}


def test_an_illegal_address_at_synchronize_makes_the_service_leave_with_70(tmp_path: Path) -> None:
    engine_in_store(tmp_path / "store", "mlp", SHA)
    argv = serve_on_fake_gpu(_config(tmp_path), fault=("CUDA_ERROR_ILLEGAL_ADDRESS", POISON))
    with PidOne(argv) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")  # warmed up on the double: the engine ran every profile point
        status, body = post(pid1.address, "/v2/models/mlp/infer", _infer([1.0, 2.0, 3.0, 4.0]))
        assert status == 200 and body["outputs"][0]["data"] == [3.0, 5.0, 7.0, 9.0]
        status, body = post(pid1.address, "/v2/models/mlp/infer", _infer([1.0, POISON, 3.0, 4.0]))
        assert status == 503 and "CUDA_ERROR_ILLEGAL_ADDRESS" in body["error"]["message"], body
        stopping = pid1.wait_for("STOPPING", "1")
        assert "engine mlp" in stopping.fields["STATUS"] and "CUDA_ERROR_ILLEGAL_ADDRESS" in stopping.fields["STATUS"]
        code = pid1.proc.wait(60)
        log = pid1.log_tail(100_000)
    assert code == EX_SOFTWARE, log  # restartable: not in RestartPreventExitStatus=
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "engine mlp" in errors[0] and "CUDA_ERROR_ILLEGAL_ADDRESS" in errors[0], log
    assert "Traceback" not in log and "not torn down" not in log  # the exit frees the lost context
    # a crash of the serving phase, by the service's own word: recorded and counted as one
    crash = json.loads((tmp_path / "state" / "last-crash.json").read_text())
    assert (crash["result"], crash["phase"], crash["signal"]) == ("crashed", "serving", "none")
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in crash["error"] and crash["exit_code"] == EX_SOFTWARE
    [journal] = (tmp_path / "state" / "journal").glob("*.jsonl")
    assert json.loads(journal.read_text().splitlines()[-1])["end"] == "crashed"


def _worker(tmp_path: Path, gpu) -> "EngineWorker":  # noqa: F821
    """An engine worker with a TrtSession over the CUDA and TensorRT doubles."""
    import json

    from edge.device.cuda import CudaApi
    from edge.engines.key import EngineKey
    from edge.engines.store import StoredEngine
    from edge.engines.trt_session import TrtSession
    from edge.serve.worker import EngineWorker
    from fakecuda import FakeTensorRT
    from kit.gpudouble import DOUBLE_PROFILES

    data = json.dumps({"inputs": {"x": "FLOAT"}, "outputs": {"y": "FLOAT"}, "profiles": [{"x": [1, 8]}]}).encode()
    key = EngineKey(model="mlp", model_sha256=SHA, backend="tensorrt", target="sm_87", precision="fp16")
    stored = StoredEngine(key, tmp_path / "mlp.engine", hashlib.sha256(data).hexdigest(), len(data),
                          {"build": {"profiles": DOUBLE_PROFILES}})
    worker = EngineWorker("mlp", stored)
    worker.open(data, make=lambda s, d: TrtSession(s, d, api=CudaApi(gpu.driver), trt=FakeTensorRT(gpu)))
    return worker


def test_after_the_fatal_error_readiness_fails_and_no_request_reaches_the_gpu(tmp_path: Path) -> None:
    from fakecuda import FakeGpu

    gpu = FakeGpu(fault=("CUDA_ERROR_LAUNCH_FAILED", POISON))
    worker = _worker(tmp_path, gpu)
    reasons: list[str] = []
    state = ServiceState(workers={}, engines={"mlp": worker}, ready=True, on_fatal=reasons.append)

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as c:
            return [await c.get("/readyz"), await c.post("/v2/models/mlp/infer", json=_infer([1, POISON, 3, 4])),
                    await c.get("/readyz"), await c.get("/v2/health/ready"),
                    await c.post("/v2/models/mlp/infer", json=_infer([1, 2, 3, 4])),
                    await c.post("/v1/completions", json={"prompt": "hi"})]

    try:
        ready, lost, after, kserve_ready, again, completion = asyncio.run(go())
    finally:
        calls = len(gpu.log)
        worker.close()  # a lost session is not torn down: no CUDA call
    assert ready.status_code == 200 and lost.status_code == 503 and lost.headers["retry-after"] == "1"
    assert reasons == ["engine mlp: CUDA cuStreamSynchronize failed: CUDA_ERROR_LAUNCH_FAILED"]  # once
    assert after.status_code == 503 and after.json() == {"status": "failed", "reason": reasons[0]}
    assert kserve_ready.status_code == 503
    assert again.status_code == 503 and completion.status_code == 503  # refused before any work
    assert len(gpu.log) == calls and gpu.order()[-1] == "fault"  # nothing went to the GPU after the fault
