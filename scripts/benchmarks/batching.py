"""KServe throughput of one ONNX Runtime engine at C concurrent clients, batched (edge's dynamic
batcher, `[engines.batching]` defaults) vs one request at a time (`enabled = false`), in one run
(JSON with the ratio and the load average). `scripts/bench engines --batching`.

One `edge serve` serves the same stored engine twice, as `batched` and `single`; rounds
alternate between them, so drift and the other load on the machine hit both alike; the service's
CPU time per request is reported too (what the machine's other load does not change). The model is
an MLP of realistic width, 256 -> 4096 -> 4096 -> 16 (17.9 M FP32 weights, 72 MB: the feed-forward
block of a ~1B-parameter transformer), made by scripts/harness/onnxgen.py: one row is a matrix-vector
product that streams every weight from memory, so one call costs nearly what eight do, as on a
Jetson's GPU. Every answer is checked against the request's own answer alone (ONNX Runtime on the
ONNX, one row); a wrong one makes the exit status 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


from benchmarks.common import emit, env_for_bench, start_edge, summary
from harness.onnxgen import make_mlp

from edge.device.identity import detect
from edge.engines.build import build_engine
from edge.engines.recipe import load_recipe
from edge.engines.store import EngineStore

N_IN, HIDDEN, DEPTH, N_OUT = 256, 4096, 2, 16
MODEL = f"MLP {N_IN} -> {' -> '.join([str(HIDDEN)] * DEPTH)} -> {N_OUT}, FP32, ONNX Runtime (CPU)"


def build(folder: Path) -> tuple[Path, Path]:
    """The wide MLP, its recipe (rows 1..64) and its ORT engine: (the ONNX, the store)."""
    onnx = make_mlp(folder / "wide-mlp.onnx", n_in=N_IN, hidden=HIDDEN, n_out=N_OUT, depth=DEPTH)
    recipe = folder / "wide-mlp.toml"
    recipe.write_text(f'name = "wide-mlp"\nonnx = "{onnx.name}"\nprecision = "fp32"\n[[profiles]]\n'
                      f'name = "default"\n[[profiles.inputs]]\nname = "x"\nmin = [1, {N_IN}]\n'
                      f'opt = [8, {N_IN}]\nmax = [64, {N_IN}]\n')
    build_engine(load_recipe(recipe), "onnxruntime", EngineStore(folder / "store"), detect(), log=lambda s: None)
    return onnx, folder / "store"


def config(folder: Path, recipe: Path, store: Path, delay_us: int) -> Path:
    engines = "".join(f'[[engines]]\nname = "{name}"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\n'
                      f'store = "{store}"\n[engines.batching]\n{table}\n'
                      for name, table in (("batched", f"max_queue_delay_us = {delay_us}"),
                                          ("single", "enabled = false")))
    cfg = folder / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{folder / "state"}"\n'
                   f'cache_dir = "{folder / "cache"}"\n' + engines)
    return cfg


def body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def round_of(address: tuple[str, int], engine: str, bodies: list[list[bytes]]) -> tuple[float, list[list[Any]]]:
    """Each client sends its bodies in turn on one keep-alive connection, all released together:
    (the wall seconds of the round, each client's outputs)."""
    gate = threading.Barrier(len(bodies) + 1)
    outputs: list[list[Any]] = [[] for _ in bodies]

    def client(i: int) -> None:
        c = http.client.HTTPConnection(*address, timeout=300)
        gate.wait()
        for b in bodies[i]:
            c.request("POST", f"/v2/models/{engine}/infer", b, {"Content-Type": "application/json"})
            r = c.getresponse()
            answer = json.loads(r.read())
            outputs[i].append(answer["outputs"][0]["data"] if r.status == 200 else answer)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, outputs


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(address: tuple[str, int], name: str, engine: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    c = http.client.HTTPConnection(*address, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("engine") == engine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="per client per round")
    ap.add_argument("--rounds", type=int, default=3, help="per engine, alternating")
    ap.add_argument("--delay-us", type=int, default=0, help="the batched engine's max_queue_delay_us")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="edge-bench-batching-"))
    onnx, store = build(folder)
    rng = np.random.default_rng(0)
    xs = [[rng.standard_normal((1, N_IN)).astype(np.float32) for _ in range(args.requests)]
          for _ in range(args.clients)]
    bodies = [[body(x) for x in row] for row in xs]
    import onnxruntime as ort  # the reference: each request's answer alone

    ref = ort.InferenceSession(str(onnx))
    want = [[ref.run(None, {"x": x})[0].ravel() for x in row] for row in xs]
    cfg = config(folder, folder / "wide-mlp.toml", store, args.delay_us)
    seconds: dict[str, list[float]] = {"batched": [], "single": []}
    cpu: dict[str, list[float]] = {"batched": [], "single": []}
    wrong, load = 0, [os.getloadavg()]
    with start_edge(cfg, env_for_bench()) as edge:
        edge.ready_at()
        for _ in range(args.rounds):
            for engine in ("batched", "single"):  # alternating rounds
                c0 = cpu_seconds(edge.pid)
                s, outputs = round_of(edge.address, engine, bodies)
                seconds[engine].append(s)
                cpu[engine].append((cpu_seconds(edge.pid) - c0) / (args.clients * args.requests))
                wrong += sum(not (isinstance(o, list) and np.allclose(o, w, rtol=1e-5, atol=1e-6))
                             for row_o, row_w in zip(outputs, want) for o, w in zip(row_o, row_w))
        executions = scrape(edge.address, "edge_engine_batch_size_count", "batched")
        batched = scrape(edge.address, "edge_engine_batch_size_sum", "batched")
        load.append(os.getloadavg())
    n = args.clients * args.requests
    rps = {e: [n / s for s in v] for e, v in seconds.items()}
    ratio = statistics.median(rps["batched"]) / statistics.median(rps["single"])
    result = {"model": MODEL, "clients": args.clients, "requests_per_round": n, "rounds": args.rounds,
              "max_queue_delay_us": args.delay_us, "cpus": os.cpu_count(),
              "batched_requests_per_s": summary(rps["batched"]), "single_requests_per_s": summary(rps["single"]),
              "ratio_batched_over_single": round(ratio, 3),
              # each batched round over the one-at-a-time round right after it: the same load
              "ratio_per_round_pair": [round(b / o, 2) for b, o in zip(rps["batched"], rps["single"])],
              # the service's CPU time per request: what the load on a shared machine does not change
              "batched_cpu_ms_per_request": summary([c * 1e3 for c in cpu["batched"]]),
              "single_cpu_ms_per_request": summary([c * 1e3 for c in cpu["single"]]),
              "cpu_ratio_single_over_batched":
                  round(statistics.median(cpu["single"]) / statistics.median(cpu["batched"]), 3),
              "mean_batch_size": round(batched / executions, 2) if executions else None,
              "wrong_answers": wrong, "loadavg_before": load[0], "loadavg_after": load[1]}
    print(f"batched {statistics.median(rps['batched']):.1f} req/s vs one at a time "
          f"{statistics.median(rps['single']):.1f} req/s -> {ratio:.2f}x (load {load[1][0]:.2f})", file=sys.stderr)
    emit(result, "engines-batching")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
