"""One-shot GPU check: what the CPU test suite cannot show, on a machine with an NVIDIA GPU.

No network, only what is installed; one table on stdout; under 5 minutes. Rows:
- gpu: GPU 0 through edge's driver path (cuda-python, cuInit, the primary context, one byte).
- device: `edge device`'s detection on this host (SM from the GPU, platform, unified memory).
- unit devices: the unit `edge units install` renders here, its DeviceAllow= against this host's
  real GPU nodes and /proc/devices (edge doctor's check).
- oneshot nodes: the nodes edge-nvidia-uvm.service promises (nvidiactl, each /dev/nvidiaN,
  nvidia-uvm and -tools; the commands run first where this is root), as real char devices with
  the majors and minors nvidia-modprobe gives them.
- units verify: `systemd-analyze verify` of the rendered units.
- sticky error: a real `edge serve` whose engine is a PTX kernel the GPU runs (kit.ptxtrt: only
  TensorRT is a double): 200, then an input that faults on the GPU -> 503 naming
  CUDA_ERROR_ILLEGAL_ADDRESS -> exit 70 -> last-crash.json (crashed, serving).
- Where TensorRT's builder is importable: the demo engine built and served (KServe requests at
  every profile's min/opt/max compared with ONNX Runtime), a data-dependent-shape and a BF16
  engine refused at load; a tiny GGUF with every layer offloaded where llama-cpp-python has CUDA.
  Otherwise each is a "skipped" row saying why.

Without a GPU: one line, exit 0 ("skipped"). `--require-gpu` (what a device check runs): without
a GPU one line naming why, exit 1; with one, any failed row fails the check (exit 1).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge.device.identity import detect, probe_gpu
from edge.serve.client import request as http
from edge.timing import REPORT_NAME
from harness import EDGE, PidOne, post  # scripts/harness: beside this file, so on sys.path

ROOT = Path(__file__).resolve().parent.parent

RECIPE = ROOT / "engines" / "mlp-demo.toml"
BUDGET_S = 240.0  # the optional TensorRT steps start only within this; the whole check < 5 min
NVIDIA_MAJOR = 195  # nvidia-modprobe-utils.h: NV_MAJOR_DEVICE_NUMBER; nvidiactl is minor 255
Row = tuple[str, str, str]  # step, ok | fail | skipped, what was seen


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
    report = json.loads((folder / "state" / REPORT_NAME).read_text())
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
    from harness.ggufgen import write_tiny_llama

    return write_tiny_llama(folder / "tiny.gguf")


def driver_rows() -> list[Row]:
    """The unit rendered for this host against its real nodes, and the oneshot's promised nodes."""
    from edge.host.doctor_gpu import unit_device_checks
    from edge.host.gpu_nodes import nvidia_minors, platform_policy, render_uvm
    from edge.host.units import UnitOptions, render_rearm, render_service, render_socket

    policy = platform_policy("/")
    o = UnitOptions(devices=policy.devices, modprobe=policy.modprobe)
    (_, level, msg, _), = unit_device_checks(render_service(o), probe=False)
    rows: list[Row] = [("unit devices", "ok" if level == "ok" else "fail", f"{policy.platform}: {msg}")]
    units = {"edge.socket": render_socket(o), "edge.service": render_service(o), "edge-socket-rearm.service": render_rearm(o)}
    if policy.platform in ("dgpu", "jetpack7"):
        minors = nvidia_minors(policy.devices)
        uvm = render_uvm(policy.modprobe or "/usr/bin/nvidia-modprobe", minors)
        if policy.modprobe:
            units["edge-nvidia-uvm.service"] = uvm
        rows.append(oneshot_row(uvm, minors, policy.modprobe))
    rows.append(verify_row(units))
    return rows


def oneshot_row(uvm: str, minors: tuple[int, ...], modprobe: str | None, dev: Path = Path("/dev"),
                proc_devices: Path = Path("/proc/devices")) -> Row:
    """Runs the oneshot's commands as the unit would (root only; failures ignored, as `-` does),
    then every node it promises must be a char device with nvidia-modprobe's major:minor."""
    import os
    import stat

    from edge.host.doctor_gpu import char_majors

    ran = ""
    if modprobe and os.geteuid() == 0:
        cmds = [line.lstrip("-").split() for line in re.findall(r"^ExecStart=(.+)$", uvm, re.M)]
        codes = [subprocess.run(c, capture_output=True, timeout=60).returncode for c in cmds]
        ran = f"ran {len(cmds)} nvidia-modprobe commands (exit {codes}); "
    uvm_major = next(iter(char_majors(proc_devices.read_text()).get("nvidia-uvm", {-1})))
    want = {"nvidiactl": (NVIDIA_MAJOR, 255), **{f"nvidia{n}": (NVIDIA_MAJOR, n) for n in minors},
            "nvidia-uvm": (uvm_major, 0), "nvidia-uvm-tools": (uvm_major, 1)}
    wrong = []
    for name, (major, minor) in want.items():
        try:
            st = os.stat(dev / name)
        except OSError as exc:
            wrong.append(f"/dev/{name}: {exc.strerror}")
            continue
        seen = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if not stat.S_ISCHR(st.st_mode) or seen != (major, minor):
            wrong.append(f"/dev/{name}: {seen[0]}:{seen[1]}, expected {major}:{minor}")
    detail = ran + (f"wrong: {'; '.join(wrong)}" if wrong else f"{len(want)} nodes as nvidia-modprobe makes them")
    return ("oneshot nodes", "fail" if wrong else "ok", detail)


def verify_row(units: dict[str, str]) -> Row:
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        return ("units verify", "skipped", "systemd-analyze is not installed")
    with tempfile.TemporaryDirectory(prefix="edge-units-") as d:
        for name, text in units.items():
            (Path(d) / name).write_text(text)
        r = subprocess.run([analyze, "verify", *sorted(str(Path(d) / n) for n in units)], capture_output=True,
                           text=True, cwd=d, timeout=60)
    bad = r.returncode != 0 or any(n in r.stderr for n in units)
    return ("units verify", "fail" if bad else "ok", (r.stderr.strip()[:300] if bad else f"{len(units)} units accepted"))


def sticky_row(folder: Path, serve: Any = None, device: Any = None) -> Row:
    """edge serve on the real driver (TensorRT: kit.ptxtrt's double): a good request, then one the
    GPU faults on; the service must answer 503, exit 70 and record the crash. `serve`/`device`:
    the argv maker and the engine key's device (the CPU test passes the CUDA double's)."""
    import hashlib

    from edge.errors import EX_SOFTWARE
    from kit.gpudouble import engine_in_store, serve_on_real_gpu
    from kit.ptxtrt import POISON, PtxTensorRT

    if serve is None:
        serve, device = serve_on_real_gpu, detect(trt=lambda: PtxTensorRT.__version__)
    sha = hashlib.sha256(b"gpu-check sticky engine").hexdigest()
    engine_in_store(folder / "sticky-store", "mlp", sha, device=device)
    cfg = folder / "sticky.toml"
    cfg.write_text(f'[server]\nhost = "127.0.0.1"\nport = 0\n[paths]\nstate_dir = "{folder / "sticky-state"}"\n'
                   f'cache_dir = "{folder / "sticky-cache"}"\n[[engines]]\nname = "mlp"\nbackend = "tensorrt"\n'
                   f'onnx_sha256 = "{sha}"\nprecision = "fp16"\nstore = "{folder / "sticky-store"}"\n')

    def infer(x: list[float]) -> dict:
        return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x}]}

    with PidOne(serve(cfg)) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        good, body = post(pid1.address, "/v2/models/mlp/infer", infer([1.0, 2.0, 3.0, 4.0]))
        if good != 200 or body["outputs"][0]["data"] != [3.0, 5.0, 7.0, 9.0]:
            return ("sticky error", "fail", f"the PTX engine's first answer: HTTP {good} {str(body)[:200]}")
        status, body = post(pid1.address, "/v2/models/mlp/infer", infer([1.0, POISON, 3.0, 4.0]))
        code = pid1.proc.wait(60)
    crash_file = folder / "sticky-state" / "last-crash.json"
    crash = json.loads(crash_file.read_text()) if crash_file.exists() else {}
    message = str(body.get("error", {}).get("message", body)) if isinstance(body, dict) else str(body)
    ok = (status == 503 and "CUDA_ERROR_ILLEGAL_ADDRESS" in message and code == EX_SOFTWARE
          and (crash.get("result"), crash.get("phase")) == ("crashed", "serving")
          and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(crash.get("error")))
    named = re.search(r"CUDA_ERROR_\w+", message)
    return ("sticky error", "ok" if ok else "fail", f"200, then HTTP {status} ({named.group(0) if named else message[:80]}) "
            f"-> exit {code} -> last-crash.json {crash.get('result')}/{crash.get('phase')}")


def tensorrt_rows(folder: Path, device: Any, started: float) -> list[Row]:
    if not tensorrt_builder():
        return [("tensorrt engine", "skipped", "TensorRT's builder is not importable here (docs/install.md: Installing "
                 "the GPU path); the driver path above ran without it")]
    store = folder / "store"
    build = build_demo("tensorrt", store, device)
    gguf = tiny_gguf(folder)
    served = serve_and_query(folder, "tensorrt", store, gguf)
    bad = [r for r in served["requests"] if not r["ok"]]
    rows: list[Row] = [("tensorrt engine", "fail" if bad or served["exit_code"] != 0 else "ok",
                        f"built in {build['seconds']} s, ready in {served['ready_s']} s, "
                        f"{len(served['requests']) - len(bad)}/{len(served['requests'])} profile points match "
                        f"ONNX Runtime, exit {served['exit_code']}")]
    offload = served.get("gguf_offload")
    rows.append(("gguf offload", "skipped" if not gguf else "ok" if offload and offload["ok"] else "fail",
                 "llama-cpp-python is not a CUDA build" if not gguf else f"HTTP {offload and offload['status']}"))
    if time.monotonic() - started > BUDGET_S:
        return rows + [("refusals", "skipped", "out of time")]
    for what, v in refusals(folder, device).items():
        state = "skipped" if v["ok"] is None else "ok" if v["ok"] else "fail"
        rows.append((f"refuse {what}", state, v.get("refused") or v.get("note", "")))
    return rows


def run(folder: Path, started: float) -> list[Row]:
    probe = probe_gpu(work=True)
    if probe.gpu is None:
        return [("gpu", "none", f"no usable GPU: {probe.error}")]
    rows: list[Row] = [("gpu", "ok", f"{probe.gpu.name} {probe.gpu.sm}, driver CUDA {probe.driver}; primary "
                        "context retained, one byte allocated")]
    device = detect()
    rows.append(("device", "ok" if device.sm == probe.gpu.sm else "fail",
                 f"platform {device.platform}, SM {device.sm} (from {device.sm_source}), unified memory "
                 f"{device.unified_memory}, CUDA {device.cuda} (from {device.cuda_source})"))
    for step in (driver_rows, lambda: [sticky_row(folder)], lambda: tensorrt_rows(folder, device, started)):
        try:
            rows += step()
        except Exception as exc:  # one table whatever happens: the failing step names what it saw
            rows.append(("error", "fail", f"{type(exc).__name__}: {exc}"[:400]))
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{step:<{width}}  {state:<7}  {' '.join(detail.split())}" for step, state, detail in rows)


def main(argv: list[str]) -> int:
    started = time.monotonic()
    require = "--require-gpu" in argv
    with tempfile.TemporaryDirectory(prefix="edge-gpu-check-") as d:
        rows = run(Path(d), started)
    if rows[0][1] == "none":
        print(f"gpu-check: {'fail: --require-gpu, and' if require else 'skipped:'} {rows[0][2]}")
        return 1 if require else 0
    failed = [r[0] for r in rows if r[1] == "fail"]
    print(table([("step", "result", "detail"), *rows]))
    print(f"gpu-check: {'fail (' + ', '.join(failed) + ')' if failed else 'pass'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
