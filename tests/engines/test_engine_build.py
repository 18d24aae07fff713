"""Recipes, the demo ONNX, ORT build -> store -> serve -> infer, and the GPU-gated TensorRT path."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edge.device.identity import detect
from edge.engines.build import build_engine
from harness.onnxgen import make_mlp
from edge.engines.recipe import check_onnx, load_recipe
from edge.engines.store import EngineStore
from edge.errors import ConfigError, EngineError
from kit import EDGE, post

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "engines" / "mlp-demo.toml"
ort = pytest.importorskip("onnxruntime")


def test_shipped_demo_onnx_is_what_the_generator_makes(tmp_path: Path) -> None:
    assert make_mlp(tmp_path / "m.onnx").read_bytes() == (ROOT / "engines" / "mlp-demo.onnx").read_bytes()


def _recipe(tmp_path: Path, body: str, onnx: bytes | None = None) -> Path:
    (tmp_path / "m.onnx").write_bytes(onnx if onnx is not None else (ROOT / "engines" / "mlp-demo.onnx").read_bytes())
    p = tmp_path / "r.toml"
    p.write_text('name = "m"\nonnx = "m.onnx"\n' + body)
    return p


PROFILE = '[[profiles]]\nname = "default"\n[[profiles.inputs]]\nname = "x"\n'


@pytest.mark.parametrize("body, onnx, field, words", [
    ('precision = "fp8"\n', None, "precision", "expected one of ['fp32', 'fp16', 'int8']"),
    ('workspace_mb = 0\n', None, "workspace_mb", "[1, "),
    (PROFILE + "min = [1, 16]\nopt = [4, 16]\nmax = [2, 16]\n", None, "profiles[0].inputs[0].min/opt/max[0]",
     "1 <= min <= opt <= max"),
    (PROFILE + "min = [1]\nopt = [4, 16]\nmax = [8, 16]\n", None, "profiles[0].inputs[0]", "same, non-zero rank"),
    ('colour = "red"\n', None, "colour", "unknown key"),
])
def test_bad_recipe_fields(tmp_path: Path, body, onnx, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(_recipe(tmp_path, body, onnx))
    assert info.value.field == field and words in str(info.value)


@pytest.mark.parametrize("body, words", [
    (PROFILE.replace('"x"', '"z"') + "min = [1, 16]\nopt = [4, 16]\nmax = [8, 16]\n", "input 'z' is not an input"),
    (PROFILE + "min = [1, 15]\nopt = [4, 15]\nmax = [8, 15]\n", "dim 1 is fixed at 16"),
    (PROFILE + "min = [1, 16, 1]\nopt = [4, 16, 1]\nmax = [8, 16, 1]\n", "rank 3 does not match"),
    ('[[profiles]]\nname = "empty"\n', "has dynamic dims ['batch', 16]"),
])
def test_profiles_are_checked_against_the_onnx(tmp_path: Path, body, words) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_onnx(load_recipe(_recipe(tmp_path, body)))


def test_bad_onnx_and_missing_onnx(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a valid ONNX model"):
        check_onnx(load_recipe(_recipe(tmp_path, "", b"\x08\x01garbage" * 10)))
    (tmp_path / "x").mkdir()
    p = tmp_path / "x" / "r.toml"
    p.write_text('name = "m"\nonnx = "absent.onnx"\n')
    with pytest.raises(ConfigError, match="ONNX file .*absent.onnx does not exist"):
        load_recipe(p)


def test_build_engine_cli_then_ls_verify(tmp_path: Path) -> None:
    store = tmp_path / "store"
    r = subprocess.run([*EDGE, "build-engine", str(RECIPE), "--backend", "onnxruntime", "--store", str(store)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "input  x" in r.stdout and "stored " in r.stdout
    ls = subprocess.run([*EDGE, "engines", "ls", "--store", str(store), "--json"], capture_output=True, text=True)
    (entry,) = json.loads(ls.stdout)
    assert entry["key"]["backend"] == "onnxruntime" and entry["build"]["profiles"][0]["x"]["max"] == [32, 16]
    ok = subprocess.run([*EDGE, "engines", "verify", "--store", str(store)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok")
    Path(entry["path"]).write_bytes(b"broken")
    bad = subprocess.run([*EDGE, "engines", "verify", "--store", str(store)], capture_output=True, text=True)
    assert bad.returncode == 1 and "CORRUPT" in bad.stdout


def test_trt_build_without_a_gpu_says_what_is_missing(tmp_path: Path) -> None:
    r = subprocess.run([*EDGE, "build-engine", str(RECIPE), "--store", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    if detect().sm:
        pytest.skip("this machine has a GPU: covered by the GPU test")
    # the driver's own reason (here: no libcuda), one line, no traceback
    assert r.returncode == 65 and "TensorRT engines need this device's GPU, and none could be used" in r.stderr
    assert "libcuda.so.1 cannot be loaded" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("*.engine"))


def test_served_engine_matches_the_onnx_model(ort_service) -> None:
    pid1, _ = ort_service
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    status, body = post(pid1.address, "/v2/models/mlp/infer",
                        {"id": "r1", "inputs": [{"name": "x", "shape": [5, 16], "datatype": "FP32",
                                                 "data": x.ravel().tolist()}]})
    assert status == 200 and body["id"] == "r1"
    (out,) = body["outputs"]
    ref = ort.InferenceSession(str(ROOT / "engines" / "mlp-demo.onnx")).run(None, {"x": x})[0]
    assert out["shape"] == [5, 8] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(5, 8), ref, rtol=1e-5, atol=1e-6)


def test_engine_metadata_and_report(ort_service) -> None:
    pid1, d = ort_service
    import http.client

    c = http.client.HTTPConnection(*pid1.address, timeout=30)
    c.request("GET", "/v2/models/mlp")
    meta = json.loads(c.getresponse().read())
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["platform"] == "onnxruntime_ort"
    report = json.loads((d / "state" / "last-start.json").read_text())
    names = [p["name"] for p in report["phases"]]
    for phase in ("device", "engine_lookup", "engine_read", "engine_deserialize", "warmup"):
        assert phase in names
    assert report["warmup"][0]["name"] == "floor" and report["warmup"][0]["output_shapes"] == [[1, 8]]
    rows = report["calibration"][0]["candidates"]  # the other profile shapes, each measured twice
    assert [(r["name"], r["output_shapes"]) for r in rows] == [("profile0_opt", [[4, 8]]), ("profile0_max", [[32, 8]])]


@pytest.mark.parametrize("tensor, words", [
    ({"name": "x", "shape": [2, 15], "datatype": "FP32", "data": [0.0] * 30}, "has shape [2, 15]"),
    ({"name": "x", "shape": [64, 16], "datatype": "FP32", "data": [0.0] * 1024}, "outside the engine's optimization profiles"),
    ({"name": "x", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}, "must be FP32, found INT32"),
    ({"name": "q", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}, "unknown input 'q'"),
    ({"name": "x", "shape": [2, 16], "datatype": "FP32", "data": [0.0] * 5}, "5 values do not fill shape [2, 16]"),
    ({"name": "x", "shape": [1, 16], "datatype": "FP99", "data": [0.0] * 16}, "datatype must be one of"),
    ({"name": "x", "shape": [1, 16], "datatype": "FP32", "data": ["a"] * 16}, "is not a list of FP32"),
])
def test_bad_tensors_are_400_and_the_service_keeps_serving(ort_service, tensor, words) -> None:
    pid1, _ = ort_service
    status, body = post(pid1.address, "/v2/models/mlp/infer", {"inputs": [tensor]})
    assert status == 400 and words in body["error"]["message"]
    status, _ = post(pid1.address, "/v2/models/nope/infer", {"inputs": [tensor]})
    assert status == 404
    ok, _ = post(pid1.address, "/v2/models/mlp/infer",
                 {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]})
    assert ok == 200


def test_missing_engine_for_this_device_exits_65(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{RECIPE}"\n')
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 65 and "no engine for model 'mlp-demo'" in r.stderr and "edge build-engine" in r.stderr


def _gpu_builder() -> bool:
    try:
        import tensorrt

        return hasattr(tensorrt, "Builder") and detect().sm is not None
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_builder(), reason="needs a GPU and the full TensorRT builder")
def test_tensorrt_build_deserialize_infer_matches_ort(tmp_path: Path) -> None:
    import asyncio

    from edge.lifecycle.engines import EngineWorker, read_verified

    stored = build_engine(load_recipe(RECIPE), "tensorrt", EngineStore(tmp_path), detect(), log=lambda s: None)
    worker = EngineWorker("mlp", stored)  # deserialized, served and closed on the worker thread
    try:
        worker.open(read_verified(stored))
        for batch in (1, 4, 32):
            x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            got = asyncio.run(worker.call(worker.session.infer, {"x": x}))["y"]
            ref = ort.InferenceSession(str(ROOT / "engines" / "mlp-demo.onnx")).run(None, {"x": x})[0]
            np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)  # fp16 tolerance
    finally:
        worker.close()


def test_a_failed_timing_cache_write_keeps_the_engine(tmp_path: Path, monkeypatch) -> None:
    from edge.engines import build

    def fake_tensorrt_builder(job: build.BuildJob) -> None:  # test double for TensorRT's builder
        assert job.cache_in == b""
        job.out.write_bytes(b"plan")
        job.cache_out, job.flags = b"tactics", {"fake": True}

    monkeypatch.setattr(build, "_build_tensorrt", fake_tensorrt_builder)
    dev = dataclasses.replace(detect(), sm="sm_87", tensorrt="10.3.0", gpu_name="Orin")
    store = EngineStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "timing-caches").write_text("a file where the cache folder should be")
    logs: list[str] = []
    stored = build_engine(load_recipe(RECIPE), "tensorrt", store, dev, log=logs.append)
    assert stored.path.read_bytes() == b"plan" and store.find(stored.key) == stored
    assert any("timing cache not saved" in line and "the engine is stored" in line for line in logs)
    (tmp_path / "store" / "timing-caches").unlink()
    build_engine(load_recipe(RECIPE), "tensorrt", store, dev, log=logs.append)
    cache = store.timing_cache(stored.key)
    assert cache.read_bytes() == b"tactics" and cache.parent == tmp_path / "store" / "timing-caches"
    assert "trt10.3.0" in cache.name and not (RECIPE.parent / "mlp-demo.timing.cache").exists()


def test_doctor_checks_the_engine_for_this_device(tmp_path: Path) -> None:
    from edge.host.doctor import run_checks

    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{RECIPE}"\n')
    (missing,) = [c for c in run_checks(str(cfg), []) if c.name == "engine mlp"]
    assert missing.level == "fail" and "edge build-engine" in missing.fix
    build_engine(load_recipe(RECIPE), "onnxruntime", EngineStore(tmp_path / "c" / "engines"), detect(),
                 log=lambda s: None)
    (found,) = [c for c in run_checks(str(cfg), []) if c.name == "engine mlp"]
    assert found.level == "ok" and "matches this device" in found.message


def _engine_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{RECIPE}"\n')
    return cfg


def test_corrupt_engine_is_refused_at_start(tmp_path: Path) -> None:
    cfg = _engine_config(tmp_path)
    stored = build_engine(load_recipe(RECIPE), "onnxruntime", EngineStore(tmp_path / "c" / "engines"), detect(),
                          log=lambda s: None)
    data = bytearray(stored.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.path.write_bytes(bytes(data))
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 65 and "sha256 mismatch" in r.stderr and "will not be deserialized" in r.stderr
    assert "Traceback" not in r.stderr


def test_engines_gc_cli_keeps_what_the_config_uses(tmp_path: Path) -> None:
    cfg = _engine_config(tmp_path)
    store = EngineStore(tmp_path / "c" / "engines")
    used = build_engine(load_recipe(RECIPE), "onnxruntime", store, detect(), log=lambda s: None)
    other = tmp_path / "other.toml"
    other.write_text(RECIPE.read_text().replace('name = "mlp-demo"', 'name = "mlp-old"')
                     .replace('onnx = "mlp-demo.onnx"', f'onnx = "{RECIPE.parent / "mlp-demo.onnx"}"'))
    old = build_engine(load_recipe(other), "onnxruntime", store, detect(), log=lambda s: None)
    r = subprocess.run([*EDGE, "engines", "gc", "--keep", "0", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"removed {old.path}" in r.stdout and used.path.exists() and not old.path.exists()


def test_recipe_options_the_installed_tensorrt_lacks_are_refused_before_a_build() -> None:
    import types

    from edge.engines.build import check_support

    # test double of the tensorrt module's enums: 10.3 (JetPack 6) has no SAME_COMPUTE_CAPABILITY,
    # which TensorRT 10.9 added (python/src/infer/pyCore.cpp of each release)
    trt103 = types.SimpleNamespace(__version__="10.3.0.30",
                                   HardwareCompatibilityLevel=types.SimpleNamespace(NONE=0, AMPERE_PLUS=1),
                                   BuilderFlag=types.SimpleNamespace(VERSION_COMPATIBLE=1, EXCLUDE_LEAN_RUNTIME=2))
    recipe = load_recipe(RECIPE)
    check_support(trt103, dataclasses.replace(recipe, hardware_compatibility="ampere_plus", version_compatible=True,
                                              exclude_lean_runtime=True))
    with pytest.raises(EngineError, match=r'same_compute_capability" needs TensorRT 10.9 or later .*this is '
                                          r"TensorRT 10.3.0.30"):
        check_support(trt103, dataclasses.replace(recipe, hardware_compatibility="same_compute_capability"))
