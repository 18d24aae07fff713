"""`edge serve` on the CUDA and TensorRT test doubles (tests/fakecuda.py), for machines without a
GPU: the real CLI in a subprocess whose only difference is at the hardware boundary. Before the
CLI runs, cuda-python's driver module is replaced by `FakeDriver` (edge.device.cuda.driver_module,
the one place edge gets it) and the `tensorrt` module by `FakeTensorRT`; everything else (device
detection, the engine key, the store, the worker thread, the HTTP path, sd_notify) is edge's own.

`serve_on_real_gpu` leaves the driver real and replaces `tensorrt` alone, by kit.ptxtrt's double
whose engine is a PTX kernel the real GPU runs (scripts/gpu-check, on a GPU host without TensorRT).

`engine_in_store` puts a TensorRT engine of the double's format in a store under the key this
machine has with the double's GPU (or with `device`, the real one), so that `edge serve` finds it
as it would a built one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DOUBLE_PROFILES", "engine_in_store", "serve_on_fake_gpu", "serve_on_real_gpu"]

TESTS = Path(__file__).resolve().parents[1]
DOUBLE_PROFILES = [{"x": {"min": [1, 4], "opt": [2, 4], "max": [8, 4]}}]

_RUN = """\
import json, os, sys
sys.path.insert(0, {tests!r})
import fakecuda
spec = json.loads({spec!r})
gpu = fakecuda.FakeGpu(fault=tuple(spec["fault"]) if spec.get("fault") else None)
import edge.device.cuda
edge.device.cuda.driver_module = lambda: gpu.driver
sys.modules["tensorrt"] = fakecuda.FakeTensorRT(gpu)
sys.argv = ["edge", "serve", "--config", {config!r}]
from edge.cli import main
main()
"""


def serve_on_fake_gpu(config: Path, fault: tuple[str, float] | None = None) -> list[str]:
    """argv of `edge serve --config CONFIG` on the doubles; `fault`: (CUresult, input value) of
    a kernel fault (fakecuda.FakeGpu)."""
    code = _RUN.format(tests=str(TESTS), spec=json.dumps({"fault": fault}), config=str(config))
    return [sys.executable, "-c", code]


_RUN_REAL = """\
import sys
sys.path[:0] = [{root!r}, {tests!r}, {scripts!r}]  # edge, the kit, the harness it re-exports
from kit.ptxtrt import PtxTensorRT
sys.modules["tensorrt"] = PtxTensorRT()
sys.argv = ["edge", "serve", "--config", {config!r}]
from edge.cli import main
main()
"""


def serve_on_real_gpu(config: Path) -> list[str]:
    """argv of `edge serve --config CONFIG` on the real driver, TensorRT being kit.ptxtrt's double."""
    return [sys.executable, "-c", _RUN_REAL.format(root=str(TESTS.parent), tests=str(TESTS), scripts=str(TESTS.parent / "scripts"),
                                               config=str(config))]


def engine_in_store(store: Path, name: str, onnx_sha256: str, precision: str = "fp16", device: Any = None) -> Path:
    """A y = 2x + 1 engine of the double's format, stored under this machine's key with the
    double's GPU (an Orin, TensorRT 10.3) for a config entry {name, tensorrt, onnx_sha256, precision}."""
    sys.path.insert(0, str(TESTS))
    from fakecuda import FakeGpu, FakeTensorRT

    from edge.config import EngineConfig
    from edge.device.identity import detect, probe_gpu
    from edge.engines.key import key_for
    from edge.engines.store import EngineStore

    device = device or detect(gpu=lambda: probe_gpu(FakeGpu().driver), trt=lambda: FakeTensorRT.__version__)
    key = key_for(EngineConfig(name=name, backend="tensorrt", onnx_sha256=onnx_sha256, precision=precision), device)
    st = EngineStore(store)
    tmp = st.tmp_path(key)
    tmp.write_text(json.dumps({"inputs": {"x": "FLOAT"}, "outputs": {"y": "FLOAT"}, "profiles": [{"x": [1, 8]}]}))
    return st.put(key, tmp, {"profiles": DOUBLE_PROFILES}).path
