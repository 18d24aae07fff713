"""Dynamic batching of engine requests (edge.engines.dynamic_batching) on real ONNX Runtime engines: batches
form, each answer equals the request's answer alone, groups by shape, a failing request fails
alone, the policy's checks; and over real sockets, `edge serve` batching concurrent clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge.config import BatchingConfig
from edge.errors import ConfigError, RequestError
from edge.engines.dynamic_batching import batch_policy, batch_rows
from edge.serve.worker import EngineWorker
from kit import EDGE, PidOne, metric, post
from harness.onnxgen import make_gather, make_mlp, make_rowsum, make_static, make_total

ort = pytest.importorskip("onnxruntime")

MLP = {"x": ([1, 16], [4, 16], [32, 16])}
SLOW = 1_000_000  # µs: a delay no test waits out; a batch forms when its preferred rows are queued


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, build_ort_engine: Callable[..., Any]) -> dict[str, Any]:
    """name -> (recipe, StoredEngine) of every test model."""
    d = tmp_path_factory.mktemp("batch-engines")
    models = {"mlp": (make_mlp, MLP), "rowsum": (make_rowsum, {"x": ([1, 1], [4, 4], [32, 8])}),
              "gather": (make_gather, {"x": ([1, 4], [4, 4], [16, 4]), "i": ([1, 1], [4, 1], [16, 1])}),
              "total": (make_total, {"x": ([1, 4], [4, 4], [16, 4])}), "static": (make_static, {})}
    return {n: build_ort_engine(d, make(d / f"{n}.onnx"), prof) for n, (make, prof) in models.items()}


def open_worker(engines: dict[str, Any], name: str, **batching: Any) -> EngineWorker:
    stored = engines[name][1]
    w = EngineWorker(name, stored, BatchingConfig(**batching))
    w.open(stored.path.read_bytes())
    return w


def run_all(worker: EngineWorker, requests: list[dict[str, np.ndarray]]) -> list[Any]:
    """Every request submitted at once, from one event loop: their outputs or errors, in order."""
    async def go() -> list[Any]:
        return await asyncio.gather(*(worker.infer(r) for r in requests), return_exceptions=True)
    return asyncio.run(go())


def rows(n: int, seed: int, width: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def test_concurrent_requests_run_as_one_batch_and_each_gets_its_answer_alone(engines) -> None:
    w = open_worker(engines, "mlp", max_queue_delay_us=SLOW, preferred_batch_size=9)
    try:
        requests = [{"x": rows(1 + i % 2, seed=i)} for i in range(6)]  # 9 rows in all
        got = run_all(w, requests)
        assert w.batcher.executions == 1
        for r, out in zip(requests, got):
            alone = w.session.infer(r)["y"]
            assert out["y"].shape == alone.shape
            np.testing.assert_allclose(out["y"], alone, rtol=1e-5, atol=1e-6)
        size = w.batcher.stats.batch_size
        assert size.sum == 6 and size.cumulative()[-1] == ("+Inf", 1)
    finally:
        w.close()


def test_requests_whose_shapes_do_not_concatenate_run_in_separate_groups(engines) -> None:
    w = open_worker(engines, "rowsum", max_queue_delay_us=SLOW, preferred_batch_size=2)
    try:
        requests = [{"x": rows(1, seed=i, width=(3, 5)[i % 2])} for i in range(4)]  # widths 3, 5, 3, 5
        got = run_all(w, requests)
        assert w.batcher.executions == 2  # one per width, each of two requests
        for r, out in zip(requests, got):
            np.testing.assert_allclose(out["y"], 2 * r["x"].sum(axis=1, keepdims=True), rtol=1e-5)
    finally:
        w.close()


def test_a_request_that_makes_the_engine_fail_fails_alone(engines) -> None:
    w = open_worker(engines, "gather", max_queue_delay_us=SLOW, preferred_batch_size=3)
    try:
        x = rows(3, seed=7, width=4)
        index = [1, 9, 2]  # 9 is past the row's 4 values: ONNX Runtime refuses that request's data
        requests = [{"x": x[k:k + 1], "i": np.array([[index[k]]], np.int64)} for k in range(3)]
        ok1, bad, ok2 = run_all(w, requests)
        assert isinstance(bad, RequestError) and bad.status == 422 and bad.code == "engine_failed"
        assert "GatherElements" in str(bad)
        assert ok1["y"].tolist() == [[x[0, 1]]] and ok2["y"].tolist() == [[x[2, 2]]]
        assert w.batcher.executions == 1 + 3  # the batch, then each of its members alone
    finally:
        w.close()


def test_a_batch_is_at_most_max_batch_size_rows_in_arrival_order(engines) -> None:
    w = open_worker(engines, "mlp", max_queue_delay_us=SLOW, max_batch_size=4, preferred_batch_size=3)
    try:
        requests = [{"x": rows(n, seed=n)} for n in (3, 2, 1)]
        got = run_all(w, requests)
        assert w.batcher.executions == 2  # [3 rows], then [2 + 1]: the 1-row one does not overtake
        assert [o["y"].shape[0] for o in got] == [3, 2, 1]
        assert w.batcher.stats.batch_size.sum == 3
    finally:
        w.close()


def test_an_engine_whose_outputs_do_not_follow_the_rows_stops_batching(engines, caplog) -> None:
    w = open_worker(engines, "total", max_queue_delay_us=SLOW, preferred_batch_size=4)
    try:
        requests = [{"x": rows(2, seed=i, width=4)} for i in range(2)]
        got = run_all(w, requests)
        for r, out in zip(requests, got):  # run again one at a time: each its own answer
            np.testing.assert_array_equal(out["y"], np.concatenate([r["x"], r["x"]]))
        assert not w.batcher.enabled and "batching turned off" in caplog.text
        assert w.batcher.executions == 3
        run_all(w, requests)
        assert w.batcher.executions == 3  # from now on the worker runs requests itself, one at a time
    finally:
        w.close()


def test_at_the_drain_limit_queued_engine_requests_get_503_and_later_ones_too(engines) -> None:
    """EngineWorker.end (the drain's limit): what waits in the batcher's queue gets the error at
    once (a 503, never a cancelled task), and a later request is refused with it, batched or not."""
    from edge.serve.worker import SERVER_ENDED

    ended = RequestError("the drain's limit passed", status=503, code=SERVER_ENDED)
    w = open_worker(engines, "mlp", max_queue_delay_us=SLOW, preferred_batch_size=32)  # a batch waits for company
    alone = open_worker(engines, "mlp", enabled=False)
    try:
        async def go() -> tuple[list[Any], list[Any]]:
            queued = [asyncio.ensure_future(w.infer({"x": rows(1, seed=i)})) for i in range(3)]
            await asyncio.sleep(0)  # queued: the batch waits for 32 rows, SLOW at the most
            w.end(ended)
            alone.end(ended)
            got = await asyncio.gather(*queued, return_exceptions=True)
            later = await asyncio.gather(w.infer({"x": rows(1, 9)}), alone.infer({"x": rows(1, 9)}),
                                         alone.call(alone.session.infer, {"x": rows(1, 9)}), return_exceptions=True)
            return got, later

        got, later = asyncio.run(go())
        assert all(isinstance(e, RequestError) and e.code == SERVER_ENDED for e in got + later), got + later
        assert w.batcher.executions == 0
    finally:
        w.close()
        alone.close()


def test_without_batching_each_request_is_its_own_execution(engines) -> None:
    w = open_worker(engines, "mlp", enabled=False)
    try:
        assert w.batcher is None
        got = run_all(w, [{"x": rows(1, seed=i)} for i in range(3)])
        assert all(o["y"].shape == (1, 8) for o in got)
    finally:
        w.close()


def test_batch_rows_come_from_the_profiles_and_name_what_is_missing(engines) -> None:
    for name, want in (("mlp", 32), ("gather", 16), ("rowsum", 32)):
        w = open_worker(engines, name, enabled=False)
        try:
            assert batch_rows(w.session) == (want, "")
        finally:
            w.close()
    w = open_worker(engines, "static", enabled=False)
    try:
        assert batch_rows(w.session) == (0, "input 'x' has shape [2, 4], whose first dim is not dynamic")
        assert batch_policy(w.session, BatchingConfig(), "edge.toml", "engines[0].batching") is None
    finally:
        w.close()


@pytest.mark.parametrize("name, batching, field, words", [
    ("static", {"enabled": True}, "enabled", "the engine has no batch dimension (input 'x' has shape [2, 4]"),
    ("mlp", {"max_batch_size": 64}, "max_batch_size", "expected at most 32, the most rows"),
    ("mlp", {"preferred_batch_size": 33}, "preferred_batch_size", "expected at most 32"),
    ("mlp", {"max_batch_size": 0, "preferred_batch_size": 40}, "preferred_batch_size", "found 40"),
])
def test_a_setting_the_engine_cannot_honour_names_its_field(engines, name, batching, field, words) -> None:
    stored = engines[name][1]
    w = EngineWorker(name, stored, BatchingConfig(**batching))
    try:
        with pytest.raises(ConfigError) as e:
            w.open(stored.path.read_bytes(), where=("edge.toml", "engines[1].batching"))
        assert e.value.field == f"engines[1].batching.{field}" and words in e.value.message
        assert str(e.value).startswith(f"edge.toml: engines[1].batching.{field}: ")
    finally:
        w.close()


def test_on_tensorrt_a_batch_is_one_copy_in_and_one_execution_within_the_profile(tmp_path: Path) -> None:
    """The TensorRT path on the CUDA and TensorRT test doubles (tests/fakecuda.py: y = 2x + 1, the
    hardware boundary only): the requests' rows staged into one pinned buffer, one host-to-device
    copy, one execute_async_v3 with the batch's shape set within the profile's min/max."""
    import hashlib
    import json

    from edge.device.cuda import CudaApi
    from edge.engines.key import EngineKey
    from edge.engines.store import StoredEngine
    from edge.engines.trt_session import TrtSession
    from fakecuda import FakeGpu, FakeTensorRT

    gpu = FakeGpu()
    data = json.dumps({"inputs": {"x": "FLOAT"}, "outputs": {"y": "FLOAT"}, "profiles": [{"x": [1, 8]}]}).encode()
    key = EngineKey(model="m", model_sha256="ab" * 32, backend="tensorrt", target="sm_87", precision="fp16")
    stored = StoredEngine(key, tmp_path / "m.engine", hashlib.sha256(data).hexdigest(), len(data),
                          {"build": {"profiles": [{"x": {"min": [1, 4], "opt": [2, 4], "max": [8, 4]}}]}})
    trt, copies = FakeTensorRT(gpu), []
    real_copy = gpu.driver.cuMemcpyHtoDAsync
    gpu.driver.cuMemcpyHtoDAsync = lambda *a: (copies.append(a[2]), real_copy(*a))[1]
    w = EngineWorker("m", stored, BatchingConfig(max_queue_delay_us=SLOW, preferred_batch_size=7))
    w.open(data, make=lambda s, d: TrtSession(s, d, api=CudaApi(gpu.driver), trt=trt))
    try:
        requests = [{"x": rows(n, seed=n, width=4)} for n in (3, 1, 3)]  # 7 rows: within max 8
        copies.clear()
        got = run_all(w, requests)
        for r, out in zip(requests, got):
            np.testing.assert_array_equal(out["y"], 2 * r["x"] + 1)
        assert w.batcher.executions == 1 and copies == [7 * 4 * 4]  # one copy-in: 7 rows of 4 FP32
        assert trt.contexts[0].shapes["x"] == (7, 4)
    finally:
        w.close()


# -- over real sockets ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batching_service(engines, tmp_path_factory: pytest.TempPathFactory):
    """`edge serve` of mlp (batches of 4 preferred), rowsum (of 2), gather (of 3), warm-up off: a warm-up
    request alone would wait out the long delay these tests use so that batches form for sure."""
    d = tmp_path_factory.mktemp("batch-svc")
    tables = "".join(
        f'[[engines]]\nname = "{n}"\nbackend = "onnxruntime"\nrecipe = "{engines[n][0]}"\n'
        f'store = "{engines[n][1].path.parents[2]}"\nwarmup = false\n'
        f'[engines.batching]\nmax_queue_delay_us = {SLOW}\npreferred_batch_size = {pref}\n'
        for n, pref in (("mlp", 4), ("rowsum", 2), ("gather", 3)))
    cfg = d / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{d / "state"}"\ncache_dir = "{d / "cache"}"\n'
                   + tables)
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        yield pid1
        assert pid1.stop() == 0


def at_once(address: tuple[str, int], path: str, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """Each body from its own client thread, released together."""
    gate, answers = threading.Barrier(len(bodies)), [None] * len(bodies)

    def client(i: int) -> None:
        gate.wait()
        answers[i] = post(address, path, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers  # type: ignore[return-value]


def tensor(name: str, a: np.ndarray, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": list(a.shape), "datatype": datatype, "data": a.ravel().tolist()}


def test_concurrent_clients_are_batched_and_bad_requests_fail_alone(batching_service, engines) -> None:
    address = batching_service.address
    before = metric(address, "edge_engine_batch_size_count", engine="mlp")
    xs = [rows(1, seed=100 + i) for i in range(8)]
    bodies = [{"id": f"r{i}", "inputs": [tensor("x", x)]} for i, x in enumerate(xs)]
    bodies += [{"inputs": [tensor("x", rows(1, seed=1).astype(np.int32), "INT32")]}] * 2  # wrong datatype
    answers = at_once(address, "/v2/models/mlp/infer", bodies)
    reference = ort.InferenceSession(str(engines["mlp"][0].with_suffix(".onnx")))
    for i, (x, (status, body)) in enumerate(zip(xs, answers)):
        assert status == 200 and body["id"] == f"r{i}"
        np.testing.assert_allclose(np.array(body["outputs"][0]["data"], np.float32).reshape(1, 8),
                                   reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    for status, body in answers[8:]:
        assert status == 400 and "input 'x' must be FP32, found INT32" in body["error"]["message"]
    executions = metric(address, "edge_engine_batch_size_count", engine="mlp") - before
    assert 1 <= executions < 8  # the 8 good requests took fewer executions than requests
    assert metric(address, "edge_engine_batch_size_sum", engine="mlp") >= 8
    assert metric(address, "edge_engine_queue_delay_seconds_count", engine="mlp") >= 8


def test_over_sockets_requests_of_other_shapes_run_in_their_own_batch(batching_service) -> None:
    address = batching_service.address
    before = metric(address, "edge_engine_batch_size_count", engine="rowsum")
    xs = [rows(1, seed=i, width=(3, 5)[i % 2]) for i in range(4)]
    answers = at_once(address, "/v2/models/rowsum/infer", [{"inputs": [tensor("x", x)]} for x in xs])
    for x, (status, body) in zip(xs, answers):
        assert status == 200
        np.testing.assert_allclose(body["outputs"][0]["data"], 2 * x.sum(axis=1), rtol=1e-5)
    assert metric(address, "edge_engine_batch_size_count", engine="rowsum") - before == 2


def test_over_sockets_a_request_the_engine_fails_on_fails_alone(batching_service) -> None:
    address = batching_service.address
    x = rows(3, seed=3, width=4)
    bodies = [{"inputs": [tensor("x", x[k:k + 1]), tensor("i", np.array([[i]], np.int64), "INT64")]}
              for k, i in enumerate((0, 9, 3))]
    (s0, b0), (s1, b1), (s2, b2) = at_once(address, "/v2/models/gather/infer", bodies)
    assert (s0, s2) == (200, 200) and b0["outputs"][0]["data"] == [float(x[0, 0])]
    assert b2["outputs"][0]["data"] == [float(x[2, 3])]
    assert s1 == 422 and b1["error"]["code"] == "engine_failed" and "GatherElements" in b1["error"]["message"]
    assert metric(address, "edge_engine_batch_size_sum", engine="gather") == 3


def test_a_reload_that_changes_the_batching_table_reloads_the_engine_with_it(engines, tmp_path: Path, service) -> None:
    import signal
    import time

    recipe, stored = engines["mlp"]
    head = (f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
            f'[[engines]]\nname = "rowsum"\nbackend = "onnxruntime"\nrecipe = "{engines["rowsum"][0]}"\n'
            f'store = "{engines["rowsum"][1].path.parents[2]}"\n'
            f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\n'
            f'store = "{stored.path.parents[2]}"\nwarmup = false\n[engines.batching]\n')
    cfg = tmp_path / "edge.toml"
    cfg.write_text(head + "enabled = false\n")
    pid1 = service(cfg)
    bodies = [{"inputs": [tensor("x", rows(1, seed=i))]} for i in range(4)]
    assert [s for s, _ in at_once(pid1.address, "/v2/models/mlp/infer", bodies)] == [200] * 4
    assert metric(pid1.address, "edge_engine_batch_size_count", engine="mlp") == 0  # no batcher
    cfg.write_text(head + f"max_queue_delay_us = {SLOW}\npreferred_batch_size = 4\n")
    after = time.monotonic()
    pid1.proc.send_signal(signal.SIGHUP)
    pid1.wait_count("READY", 1, after=after)
    assert [s for s, _ in at_once(pid1.address, "/v2/models/mlp/infer", bodies)] == [200] * 4
    assert metric(pid1.address, "edge_engine_batch_size_count", engine="mlp") == 1  # all four in one batch
    # a setting the reloaded engine's profiles refuse names its field, index and all; the set serves on
    cfg.write_text(head + "max_batch_size = 33\n")
    after = time.monotonic()
    pid1.proc.send_signal(signal.SIGHUP)
    pid1.wait_count("READY", 1, after=after)
    assert "engines[1].batching.max_batch_size: expected at most 32" in pid1.log_tail(20000)
    assert post(pid1.address, "/v2/models/mlp/infer", bodies[0])[0] == 200
    assert pid1.stop() == 0


def test_a_batch_size_the_profiles_refuse_stops_the_start_naming_the_field(engines, tmp_path: Path) -> None:
    import subprocess

    recipe, stored = engines["mlp"]
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\n'
                   f'store = "{stored.path.parents[2]}"\n[engines.batching]\nmax_batch_size = 64\n')
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 78, r.stderr
    assert f"{cfg}: engines[0].batching.max_batch_size: expected at most 32" in r.stderr
