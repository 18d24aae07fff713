"""Engine keys: one key_for(entry, device) over fixture devices, and the rule for what runs where."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edge.config import EngineConfig
from edge.device.identity import GpuInfo, GpuProbe, detect
from edge.engines.key import EngineKey, build_key, key_for
from edge.engines.recipe import load_recipe
from edge.engines.store import EngineStore
from edge.errors import EngineError
from edge.fsutil import sha256_file

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parents[1] / "fixtures" / "devices"
RECIPE = ROOT / "engines" / "mlp-demo.toml"
SHA = sha256_file(ROOT / "engines" / "mlp-demo.onnx")


def no_dists(names: tuple) -> None:
    return None  # test double: no pip-installed CUDA


def device(tree: str, gpu: GpuInfo | None, trt: str | None = "10.3.0", arch: str = "aarch64", driver: str = "12.6"):
    # test doubles at the boundary: the GPU and the TensorRT module as the runtime reports them
    return detect(FIX / tree, gpu=lambda: GpuProbe(gpu, driver if gpu else None, None if gpu else "no GPU"),
                  trt=lambda: trt, cpu_arch=arch, dists=no_dists)


AGX = device("orin-agx", GpuInfo("Orin", "sm_87", integrated=True))
NANO = device("orin-nano-jp6", GpuInfo("Orin", "sm_87", integrated=True))
NANO_NO_SUPER = device("orin-nano-devkit", GpuInfo("Orin", "sm_87", integrated=True))
H100 = device("dgpu-pip-x86", GpuInfo("NVIDIA H100 80GB HBM3", "sm_90"), trt="10.13.3.9", arch="x86_64")
A100 = device("dgpu-pip-x86", GpuInfo("NVIDIA A100-SXM4-80GB", "sm_80"), trt="10.13.3.9", arch="x86_64")
GH200 = device("dgpu-pip-x86", GpuInfo("NVIDIA GH200 480GB", "sm_90"), trt="10.13.3.9", arch="aarch64")


def test_key_for_a_recipe_and_for_onnx_sha256_whatever_the_name(tmp_path: Path) -> None:
    by_recipe = key_for(EngineConfig(name="mlp", recipe=str(RECIPE)), AGX)
    assert (by_recipe.model, by_recipe.model_sha256, by_recipe.target, by_recipe.platform, by_recipe.cuda,
            by_recipe.tensorrt, by_recipe.precision) == \
        ("mlp-demo", SHA, "sm_87", "jetson-p3701-0005", "12", "10.3.0", "fp32")
    assert by_recipe.board == "jetson-agx-orin"  # a label
    store = EngineStore(tmp_path)
    built = build_key(load_recipe(RECIPE), "tensorrt", AGX, SHA)
    tmp = store.tmp_path(built)
    tmp.write_bytes(b"plan")
    store.put(built, tmp)
    # a device config naming the engine differently still finds it by the ONNX's sha256
    entry = EngineConfig(name="detector", onnx_sha256=SHA.upper(), precision="fp32")
    assert store.find(key_for(entry, AGX)).key == built
    with pytest.raises(EngineError, match="needs recipe, or onnx_sha256"):
        key_for(EngineConfig(name="x"), AGX)


def test_orins_are_told_apart_and_the_message_says_how() -> None:
    built = build_key(load_recipe(RECIPE), "tensorrt", AGX, SHA)
    wanted = key_for(EngineConfig(name="m", recipe=str(RECIPE)), NANO)
    assert built.target == wanted.target == "sm_87"
    assert built.differences(wanted) == ["engine was built for platform jetson-p3701-0005, this device is "
                                         "platform jetson-p3767-0005"]
    assert built.filename() == "sm_87-jetson-p3701-0005-cuda12-trt10.3.0-fp32.engine"


def test_an_engine_built_under_one_boards_model_string_runs_under_anothers_for_the_same_module(tmp_path: Path) -> None:
    """The Orin Nano devkit with and without "Super" in its model string (JetPack 6.2 vs 6.0):
    one module (p3767-0005), one key; the board stays a label."""
    store = EngineStore(tmp_path)
    built = build_key(load_recipe(RECIPE), "tensorrt", NANO, SHA)
    tmp = store.tmp_path(built)
    tmp.write_bytes(b"plan")
    store.put(built, tmp)
    entry = EngineConfig(name="m", recipe=str(RECIPE))
    assert NANO.jetson_model != NANO_NO_SUPER.jetson_model and NANO.board != NANO_NO_SUPER.board
    found = store.find(key_for(entry, NANO_NO_SUPER))
    assert found.key == built and found.key.board == "jetson-orin-nano-engineering-reference-super"


def test_an_engine_keyed_by_its_board_is_accepted_on_that_board_and_explained_elsewhere(tmp_path: Path) -> None:
    """Engines stored before keys named the module carry the board's slug as their platform: still
    accepted on a board of that model (what they were built on), refused on another with what
    changed and the way out; `edge engines rekey` gives them the module key."""
    entry = EngineConfig(name="m", recipe=str(RECIPE))
    old = dataclasses.replace(build_key(load_recipe(RECIPE), "tensorrt", NANO, SHA),
                              platform="jetson-orin-nano-engineering-reference-super", board=None)
    assert old.legacy_board == "jetson-orin-nano-engineering-reference-super"
    assert old.differences(key_for(entry, NANO)) == []  # the same board
    (why,) = old.differences(key_for(entry, NANO_NO_SUPER))
    assert "built for board jetson-orin-nano-engineering-reference-super (a key from before engine keys named " \
           "the Jetson module" in why and "this device is platform jetson-p3767-0005" in why
    assert "edge engines rekey" in why
    new = old.rekeyed("jetson-p3767-0005")
    assert new.legacy_board is None and new.differences(key_for(entry, NANO_NO_SUPER)) == []
    assert new.board == "jetson-orin-nano-engineering-reference-super"
    assert build_key(load_recipe(RECIPE), "tensorrt", H100, SHA).legacy_board is None  # a dGPU's product


def test_hardware_compatible_builds_run_on_other_gpus_of_their_level_on_the_same_host_platform() -> None:
    recipe = dataclasses.replace(load_recipe(RECIPE), hardware_compatibility="ampere_plus")
    entry = EngineConfig(name="m", recipe=str(RECIPE))
    built = build_key(recipe, "tensorrt", H100, SHA)
    assert (built.target, built.platform, built.host, built.hardware_compat) == ("sm_80", None, "x86-64", "ampere_plus")
    assert built.filename() == "sm_80-x86-64-cuda12-trt10.13.3.9-ampere-plus-fp32.engine"
    assert built.differences(key_for(entry, A100)) == []  # another GPU, same host platform
    # an x86 plan is refused on an Orin and on an aarch64 dGPU host, whatever the GPU
    orin_same_trt = dataclasses.replace(key_for(entry, AGX), tensorrt="10.13.3.9")
    assert built.differences(orin_same_trt) == ["engine was built for host platform x86-64, this device is "
                                                "host platform jetson"]
    assert built.differences(key_for(entry, GH200)) == ["engine was built for host platform x86-64, this "
                                                        "device is host platform aarch64"]
    old = dataclasses.replace(built, host=None)  # a manifest from before the host was in the key
    assert "host platform (none)" in old.differences(key_for(entry, A100))[0]
    turing = dataclasses.replace(key_for(entry, A100), target="sm_75")
    assert "Ampere and newer (sm_80+), this device is sm_75" in built.differences(turing)[0]
    same_cc = build_key(dataclasses.replace(recipe, hardware_compatibility="same_compute_capability"),
                        "tensorrt", H100, SHA)
    assert same_cc.differences(key_for(entry, H100)) == []
    assert same_cc.differences(key_for(entry, A100)) == ["engine was built for sm_90, this device is sm_80"]


def test_a_hardware_compatible_build_on_a_jetson_is_refused_with_the_reason() -> None:
    recipe = dataclasses.replace(load_recipe(RECIPE), hardware_compatibility="same_compute_capability")
    with pytest.raises(EngineError, match="cannot be built on a Jetson: TensorRT's hardware compatibility is "
                                          "for discrete GPUs only"):
        build_key(recipe, "tensorrt", AGX, SHA)


def test_a_missing_driver_is_the_reason_given_for_a_tensorrt_key() -> None:
    nogpu = detect(FIX / "dgpu-x86", gpu=lambda: GpuProbe(None, None, "the NVIDIA driver library libcuda.so.1 "
                                                          "cannot be loaded"), trt=lambda: "10.3.0", dists=no_dists)
    with pytest.raises(EngineError, match="none could be used: the NVIDIA driver library libcuda.so.1"):
        key_for(EngineConfig(name="m", recipe=str(RECIPE)), nogpu)
    # a Jetson's SM arch is known from its SoC: the key is made (for gc, doctor, OTA checks), and the
    # driver's error comes when the engine is deserialized
    jetson = detect(FIX / "orin-agx", gpu=lambda: GpuProbe(None, None, "cuInit failed"), trt=lambda: "10.3.0",
                    dists=no_dists)
    assert key_for(EngineConfig(name="m", recipe=str(RECIPE)), jetson).target == "sm_87"


def test_version_compatible_runs_on_later_versions_of_the_same_major() -> None:
    recipe = dataclasses.replace(load_recipe(RECIPE), version_compatible=True)
    built = build_key(recipe, "tensorrt", AGX, SHA)
    wanted = key_for(EngineConfig(name="m", recipe=str(RECIPE)), AGX)
    assert built.differences(dataclasses.replace(wanted, tensorrt="10.7.0.23")) == []
    assert built.differences(dataclasses.replace(wanted, tensorrt="10.1.0"))
    assert built.differences(dataclasses.replace(wanted, tensorrt="11.0.0"))
    plain = build_key(load_recipe(RECIPE), "tensorrt", AGX, SHA)
    assert plain.differences(dataclasses.replace(wanted, tensorrt="10.3.0.26")) == \
        ["engine was built for tensorrt 10.3.0, this device is tensorrt 10.3.0.26"]


def test_a_plan_without_its_lean_runtime_is_keyed_to_the_exact_version() -> None:
    """version_compatible + exclude_lean_runtime runs only on the lean runtime of the building
    TensorRT (IRuntime.load_runtime): its key must not let it match a later 10.x."""
    recipe = dataclasses.replace(load_recipe(RECIPE), version_compatible=True, exclude_lean_runtime=True)
    built = build_key(recipe, "tensorrt", AGX, SHA)
    wanted = key_for(EngineConfig(name="m", recipe=str(RECIPE)), AGX)
    assert built.version_compatible is False and "-vc-" not in built.filename()
    assert built.differences(wanted) == []
    assert built.differences(dataclasses.replace(wanted, tensorrt="10.7.0.23")) == \
        ["engine was built for tensorrt 10.3.0, this device is tensorrt 10.7.0.23"]


def test_unknown_cuda_is_not_a_refusal() -> None:
    built = build_key(load_recipe(RECIPE), "tensorrt", AGX, SHA)
    no_cuda = device("orin-agx", None)  # no runtime to ask, toolkit file present: 12.6
    assert no_cuda.cuda == "12.6"
    runtime_only = key_for(EngineConfig(name="m", recipe=str(RECIPE)), device("orin-nano-jp6", None))
    assert runtime_only.cuda is None  # nothing could say: compared as unknown
    assert built.differences(dataclasses.replace(runtime_only, platform="jetson-p3701-0005")) == []
    assert built.differences(dataclasses.replace(runtime_only, cuda="11", platform="jetson-p3701-0005")) == \
        ["engine was built for cuda 12, this device is cuda 11"]


def test_key_round_trips_through_the_manifest_dict() -> None:
    k = build_key(dataclasses.replace(load_recipe(RECIPE), version_compatible=True), "tensorrt", H100, SHA)
    assert EngineKey.from_dict({**k.as_dict(), "future_field": 1}) == k


def test_the_serving_path_imports_no_builder_and_no_gpu_library() -> None:
    import subprocess
    import sys

    # modules present at start are not the serving path's doing (cuda-python's .pth imports `cuda`)
    probe = ("import sys\nbefore = set(sys.modules)\nimport edge.lifecycle.engines, edge.engines.key, edge.serve.kserve\n"
             "bad = [m for m in ('edge.engines.build', 'tensorrt', 'cuda', 'cuda.bindings.runtime', 'pycuda',"
             " 'starlette', 'onnxruntime') if m in set(sys.modules) - before]\nprint(bad)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
