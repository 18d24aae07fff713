"""One-shot GPU check: what the CPU test suite cannot show, on a machine with an NVIDIA GPU.

No network, only what is installed; one JSON summary on stdout; under 8 minutes. Steps:
probe the GPU (cuda-python) -> build the demo engine (TensorRT if its builder is importable,
else ONNX Runtime) -> `edge serve` it (the engine lives on its worker thread) -> KServe requests
at every profile's min/opt/max, compared with ONNX Runtime on the ONNX -> a data-dependent-shape
engine and a BF16-input engine must be refused at load -> a tiny GGUF served with all layers
offloaded, where llama-cpp-python is built with CUDA. Without a GPU: {"result": "skipped"}, exit 0.

`--require-gpu` (what a device check runs): a check that cannot fail proves nothing, so there no
driver or GPU, no TensorRT builder, no CUDA build of llama-cpp-python, or any step skipped is
{"result": "fail"} with the reasons, exit 1.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from edge.device.identity import detect, probe_gpu  # noqa: E402
from edge.serve.client import request as http  # noqa: E402

RECIPE = ROOT / "engines" / "mlp-demo.toml"
BUDGET_S = 450.0  # the whole check stays under 8 minutes
EDGE = [sys.executable, "-m", "edge.cli"]


def tensorrt_builder() -> bool:
    try:
        import tensorrt
    except ImportError:
        return False
    return hasattr(tensorrt, "Builder")


def build_demo(backend: str, store: Path, device: Any) -> dict[str, Any]:
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore

    t0 = time.monotonic()
    stored = build_engine(load_recipe(RECIPE), backend, EngineStore(store), device, log=lambda s: None)
    return {"ok": True, "seconds": round(time.monotonic() - t0, 2), "file": stored.path.name,
            "flags": stored.meta["build"]["flags"]}


def write_config(folder: Path, backend: str, store: Path, gguf: Path | None) -> Path:
    text = (f'[server]\nport = 0\n[paths]\nstate_dir = "{folder / "state"}"\ncache_dir = "{folder / "cache"}"\n'
            f'[[engines]]\nname = "mlp"\nbackend = "{backend}"\nrecipe = "{RECIPE}"\nstore = "{store}"\n')
    if gguf:
        text += f'[[models]]\nname = "tiny"\npath = "{gguf}"\nn_ctx = 128\nn_gpu_layers = -1\n'
    cfg = folder / "edge.toml"
    cfg.write_text(text)
    return cfg


def profile_requests(address: tuple[str, int]) -> list[dict[str, Any]]:
    """Every profile's min/opt/max batch through KServe, compared with ONNX Runtime."""
    import onnxruntime as ort

    from edge.engines.recipe import load_recipe

    ref = ort.InferenceSession(str(ROOT / "engines" / "mlp-demo.onnx"), providers=["CPUExecutionProvider"])
    out = []
    for i, prof in enumerate(load_recipe(RECIPE).profiles):
        for inp in prof.inputs:
            for label, shape in (("min", inp.min), ("opt", inp.opt), ("max", inp.max)):
                x = np.random.default_rng(len(out)).standard_normal(shape).astype(np.float32)
                body = {"inputs": [{"name": inp.name, "shape": list(shape), "datatype": "FP32",
                                    "data": x.ravel().tolist()}]}
                status, raw = http(address, "POST", "/v2/models/mlp/infer", body)
                if status != 200:
                    out.append({"profile": i, "shape": label, "ok": False, "status": status, "body": raw[:300].decode()})
                    continue
                got = np.array(json.loads(raw)["outputs"][0]["data"], np.float32)
                err = float(np.abs(got - ref.run(None, {inp.name: x})[0].ravel()).max())
                out.append({"profile": i, "shape": label, "ok": err < 1e-2, "max_abs_err": err})
    return out


def serve_and_query(folder: Path, backend: str, store: Path, gguf: Path | None) -> dict[str, Any]:
    from kit import PidOne  # the test kit (tests/kit), on sys.path above

    cfg = write_config(folder, backend, store, gguf)
    result: dict[str, Any] = {}
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        t0 = time.monotonic()
        pid1.start()
        pid1.wait_for("READY", "1", timeout=180)
        result["ready_s"] = round(time.monotonic() - t0, 2)
        status, raw = http(pid1.address, "GET", "/v2/models/mlp")
        result["platform"] = json.loads(raw).get("platform") if status == 200 else f"HTTP {status}"
        result["requests"] = profile_requests(pid1.address)
        if gguf:
            status, raw = http(pid1.address, "POST", "/v1/completions",
                               {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
            result["gguf_offload"] = {"ok": status == 200, "status": status}
        result["exit_code"] = pid1.stop()
    report = json.loads((folder / "state" / "last-start.json").read_text())
    result["phases"] = {p["name"]: p["seconds"] for p in report["phases"]}
    return result


def refusal_models(folder: Path) -> dict[str, Path]:
    """Two tiny ONNX models TensorRT builds and edge must refuse at load: a data-dependent
    output shape (NonZero) and a BF16 input."""
    import onnx
    from onnx import TensorProto, helper

    def save(name: str, nodes: list, inp: Any, out: Any) -> Path:
        model = helper.make_model(helper.make_graph(nodes, name, [inp], [out]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        path = folder / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        return path

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    xb = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n", 4])
    return {
        "data_dependent_shape": save("nonzero", [helper.make_node("NonZero", ["x"], ["y"])], x,
                                     helper.make_tensor_value_info("y", TensorProto.INT64, [2, "k"])),
        "bf16_input": save("bf16", [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], xb,
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])),
    }


def refusals(folder: Path, device: Any) -> dict[str, Any]:
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.runtime import session_from_engine
    from edge.engines.store import EngineStore
    from edge.errors import EdgeError

    out: dict[str, Any] = {}
    for what, onnx_path in refusal_models(folder).items():
        recipe = folder / f"{onnx_path.stem}.toml"
        recipe.write_text(f'name = "{onnx_path.stem}"\nonnx = "{onnx_path}"\nprecision = "fp32"\n'
                          '[[profiles]]\nname = "default"\n[[profiles.inputs]]\nname = "x"\n'
                          'min = [1, 4]\nopt = [4, 4]\nmax = [8, 4]\n')
        try:
            stored = build_engine(load_recipe(recipe), "tensorrt", EngineStore(folder / "refusals"), device,
                                  log=lambda s: None)
        except EdgeError as exc:
            out[what] = {"ok": None, "note": f"TensorRT did not build it: {exc}"[:300]}
            continue
        try:
            session_from_engine(stored, stored.path.read_bytes()).close()
            out[what] = {"ok": False, "note": "loaded: edge should have refused it"}
        except EdgeError as exc:
            out[what] = {"ok": True, "refused": str(exc)[:300]}
    return out


def tiny_gguf(folder: Path) -> Path | None:
    from edge.model.gpu import llama_build

    if llama_build() != "cuda":
        return None
    from ggufgen import write_tiny_llama

    return write_tiny_llama(folder / "tiny.gguf")


def run(folder: Path, started: float, require: bool) -> dict[str, Any]:
    probe = probe_gpu()
    if probe.gpu is None:
        return {"result": "fail" if require else "skipped", "reason": f"no usable GPU: {probe.error}"}
    device = detect()
    backend = "tensorrt" if tensorrt_builder() else "onnxruntime"
    summary: dict[str, Any] = {"device": device.as_dict(), "backend": backend}
    skipped = []
    if backend != "tensorrt":
        skipped.append("tensorrt: the TensorRT builder is not importable here (README: Installing the GPU path)")
    store = folder / "store"
    summary["build"] = build_demo(backend, store, device)
    gguf = tiny_gguf(folder)
    summary["gguf"] = "served with n_gpu_layers = -1" if gguf else "skipped"
    if not gguf:
        skipped.append("gguf offload: llama-cpp-python is not a CUDA build")
    summary["serve"] = serve_and_query(folder, backend, store, gguf)
    if backend == "tensorrt" and time.monotonic() - started < BUDGET_S:
        summary["refusals"] = refusals(folder, device)
    elif backend == "tensorrt":
        skipped.append("refusals: out of time")
    skipped += [f"refusal {k}: {v['note']}" for k, v in summary.get("refusals", {}).items() if v["ok"] is None]
    checks = [r["ok"] for r in summary["serve"]["requests"]]
    checks += [v["ok"] for v in summary.get("refusals", {}).values() if v["ok"] is not None]
    checks += [summary["serve"].get("gguf_offload", {}).get("ok", True), summary["serve"]["exit_code"] == 0]
    summary["skipped"] = skipped
    summary["result"] = "pass" if all(checks) and not (require and skipped) else "fail"
    if require and skipped:
        summary["reason"] = "--require-gpu: " + "; ".join(skipped)
    return summary


def main(argv: list[str]) -> int:
    started = time.monotonic()
    require = "--require-gpu" in argv
    with tempfile.TemporaryDirectory(prefix="edge-gpu-check-") as d:
        try:
            summary = run(Path(d), started, require)
        except Exception as exc:  # one JSON line whatever happens: the summary is the interface
            summary = {"result": "fail", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary, indent=2, default=str))
    return 0 if summary["result"] in ("pass", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
