"""Start from a prebuilt engine vs. building it at start, in one run, as a ratio (JSON); with
`--batching`, KServe throughput at 8 clients batched vs one at a time (scripts/benchmarks/batching.py).

ONNX Runtime everywhere: load the ORT-format engine from the store (read, sha256, session with
optimization off) vs. optimizing the ONNX into a session at start. TensorRT too where a GPU and
the builder exist: deserialize the stored plan vs. build_serialized_network at start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


from benchmarks.common import ROOT, emit, summary
from edge.device.identity import detect
from edge.engines.build import build_engine
from edge.engines.recipe import load_recipe
from edge.engines.runtime import session_from_engine
from edge.lifecycle.engines import read_verified
from edge.engines.store import EngineStore

RECIPE = ROOT / "engines" / "mlp-demo.toml"


def first_infer(session: Any) -> None:
    try:
        session.infer({"x": np.zeros((4, 16), np.float32)})
    finally:
        session.close()  # GPU buffers, stream and the primary context's retain go each round


def prebuilt(stored: Any) -> float:
    t0 = time.perf_counter()
    first_infer(session_from_engine(stored, read_verified(stored)))
    return time.perf_counter() - t0


def build_at_start(backend: str, device: Any) -> float:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        stored = build_engine(load_recipe(RECIPE), backend, EngineStore(d), device, log=lambda s: None)
        first_infer(session_from_engine(stored, stored.path.read_bytes()))
    return time.perf_counter() - t0


def main() -> int:
    if "--batching" in sys.argv[1:]:
        from benchmarks.batching import main as batching

        return batching([a for a in sys.argv[1:] if a != "--batching"])
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    device = detect()
    backends = ["onnxruntime"]
    try:
        import tensorrt

        if hasattr(tensorrt, "Builder") and device.sm:
            backends.append("tensorrt")
    except ImportError:
        pass
    result: dict[str, Any] = {"recipe": str(RECIPE), "rounds": args.rounds, "device": device.as_dict()}
    for backend in backends:
        store = EngineStore(tempfile.mkdtemp(prefix="edge-bench-engines-"))
        stored = build_engine(load_recipe(RECIPE), backend, store, device, log=lambda s: None)
        pre, built = [], []
        for _ in range(args.rounds):  # alternate, so drift hits both alike
            pre.append(prebuilt(stored))
            built.append(build_at_start(backend, device))
        result[backend] = {"prebuilt_s": summary(pre), "build_at_start_s": summary(built),
                           "ratio_prebuilt_over_build": round(statistics.median(pre) / statistics.median(built), 3)}
        print(f"{backend}: prebuilt {statistics.median(pre) * 1e3:.1f} ms vs build at start "
              f"{statistics.median(built) * 1e3:.1f} ms -> {result[backend]['ratio_prebuilt_over_build']}x",
              file=sys.stderr)
    if "tensorrt" not in backends:
        result["tensorrt"] = "skipped: needs a GPU and the full TensorRT builder"
    emit(result, "engines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
