"""Cold start of edge vs llama-cpp-python's own server (the peer), same model, same run.

Prints JSON (also to .bench/coldstart.json) and a short table to stderr. Rounds alternate edge
and peer so that drift on the machine hits both alike. Targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test kit (tests/kit)

from benchlib import (EDGE, REQUEST, edge_config, emit, env_for_bench, free_port, gemma_path,  # noqa: E402
                      proc_memory, request_until_answered, start_peer, summary, wait_peer_up)
from kit import PidOne  # noqa: E402
from edge.pagein import evict  # noqa: E402


def edge_ttfts(cfg: Path, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env) as pid1:
        t0 = time.monotonic()
        pid1.start()
        request_until_answered(pid1.address, REQUEST)
        ttfts = time.monotonic() - t0
        pid1.wait_for("READY", "1")
        report = json.loads((cfg.parent / "state" / "last-start.json").read_text())
        assert pid1.stop() == 0, pid1.log_tail()
    return ttfts, report


def peer_ttfts(model: Path, n_ctx: int, log: Path) -> float:
    port = free_port()
    t0 = time.monotonic()
    proc = start_peer(model, port, n_ctx, log)
    try:
        request_until_answered(("127.0.0.1", port), REQUEST)
        return time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(60)


def steady(address: tuple[str, int], pid: int, n: int = 10) -> dict[str, Any]:
    first = request_until_answered(address, REQUEST)
    rest = [request_until_answered(address, REQUEST) for _ in range(n)]
    return {"first_s": first, "steady_s": statistics.median(rest), **proc_memory(pid)}


def edge_steady(cfg: Path, env: dict[str, str]) -> dict[str, Any]:
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        out = steady(pid1.address, pid1.proc.pid)
        assert pid1.stop() == 0
    return out


def peer_steady(model: Path, n_ctx: int, log: Path) -> dict[str, Any]:
    port = free_port()
    proc = start_peer(model, port, n_ctx, log)
    try:
        wait_peer_up(("127.0.0.1", port), proc)
        return steady(("127.0.0.1", port), proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def raw_read_s(model: Path) -> float:
    evict(model)
    t0 = time.monotonic()
    with open(model, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass
    return time.monotonic() - t0


def cli_times(env: dict[str, str], n: int = 5) -> dict[str, float]:
    helps, imports = [], []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([*EDGE[:1], "-m", "edge.cli", "--help"], env=env, capture_output=True, check=True)
        helps.append(time.monotonic() - t0)
        out = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); import edge.cli; "
                              "print(time.perf_counter() - t)"], env=env, capture_output=True, text=True, check=True)
        imports.append(float(out.stdout))
    edge_bin = Path(sys.executable).with_name("edge")
    scripts = []
    if edge_bin.exists():
        for _ in range(n):
            t0 = time.monotonic()
            subprocess.run([str(edge_bin), "--help"], env=env, capture_output=True, check=True)
            scripts.append(time.monotonic() - t0)
    return {"help_s": statistics.median(scripts or helps), "import_edge_cli_s": statistics.median(imports)}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-ctx", type=int, default=2048)
    args = ap.parse_args()
    env = env_for_bench()
    model = gemma_path()
    work = Path(tempfile.mkdtemp(prefix="edge-bench-"))
    cfg = edge_config(work / "edge", model, args.n_ctx)
    log = work / "peer.log"
    runs: dict[str, dict[str, list[float]]] = {"edge": {}, "peer": {}}
    mem: dict[str, dict[str, int]] = {}
    page_in_rates, raw_reads = [], []
    phases: dict[str, list[float]] = {}

    def add(who: str, key: str, val: float) -> None:
        runs[who].setdefault(key, []).append(val)

    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        t, report = edge_ttfts(cfg, env)
        add("edge", "ttfts_hot_s", t)
        for ph in report["phases"]:
            phases.setdefault(ph["name"], []).append(ph["seconds"])
        phases.setdefault("ready_s", []).append(report["ready_s"])
        add("peer", "ttfts_hot_s", peer_ttfts(model, args.n_ctx, log))
        for who, fn in (("edge", lambda: edge_steady(cfg, env)), ("peer", lambda: peer_steady(model, args.n_ctx, log))):
            s = fn()
            add(who, "first_request_s", s["first_s"])
            add(who, "steady_request_s", s["steady_s"])
            add(who, "first_over_steady", s["first_s"] / s["steady_s"])
            mem[who] = {k: max(mem.get(who, {}).get(k, 0), s[k]) for k in ("peak_rss_bytes", "locked_bytes")}
        raw_reads.append(raw_read_s(model))
        evict(model)
        t, report = edge_ttfts(cfg, env)
        add("edge", "ttfts_cold_s", t)
        page = next(p for p in report["phases"] if p["name"] == "page_in")
        page_in_rates.append(page.get("mb_per_s", 0.0))
        evict(model)
        add("peer", "ttfts_cold_s", peer_ttfts(model, args.n_ctx, log))

    size = model.stat().st_size
    result: dict[str, Any] = {
        "model": str(model), "model_bytes": size, "n_ctx": args.n_ctx, "rounds": args.rounds,
        "edge": {k: summary(v) for k, v in runs["edge"].items()} | {"memory": mem["edge"]},
        "peer": {k: summary(v) for k, v in runs["peer"].items()} | {"memory": mem["peer"]},
        "cold_cache": {"raw_sequential_read_s": summary(raw_reads),
                       "raw_read_mb_per_s": round(size / statistics.median(raw_reads) / 1e6, 1),
                       "edge_page_in_mb_per_s": summary(page_in_rates)},
        "cli": cli_times(env),
        "edge_start_phases_hot_median_s": {k: round(statistics.median(v), 4) for k, v in phases.items()},
        "edge_warmup_prompts": [REQUEST["prompt"]],
    }
    e, p = result["edge"], result["peer"]
    result["ratios_edge_over_peer"] = {
        k: ratio(e[k]["median"], p[k]["median"]) for k in runs["edge"] if k in runs["peer"]
    } | {"peak_rss": ratio(e["memory"]["peak_rss_bytes"], p["memory"]["peak_rss_bytes"])}
    targets = {
        "ttfts_hot <= 0.7 x peer": result["ratios_edge_over_peer"]["ttfts_hot_s"] <= 0.7,
        "edge first request <= 1.05 x steady": e["first_over_steady"]["median"] <= 1.05,
        "edge --help <= 0.25 s": result["cli"]["help_s"] <= 0.25,
    }
    result["targets_met"] = targets
    emit(result, "coldstart")
    rows = [("TTFTS hot (s)", "ttfts_hot_s"), ("TTFTS cold (s)", "ttfts_cold_s"),
            ("first request (s)", "first_request_s"), ("steady request (s)", "steady_request_s"),
            ("first / steady", "first_over_steady")]
    print(f"\n{'':22}{'edge':>10}{'peer':>10}{'edge/peer':>11}", file=sys.stderr)
    for label, k in rows:
        print(f"{label:22}{e[k]['median']:>10.3f}{p[k]['median']:>10.3f}"
              f"{result['ratios_edge_over_peer'][k]:>11.3f}", file=sys.stderr)
    print(f"{'peak RSS (MiB)':22}{e['memory']['peak_rss_bytes'] / 2**20:>10.0f}"
          f"{p['memory']['peak_rss_bytes'] / 2**20:>10.0f}", file=sys.stderr)
    print(f"{'locked (MiB)':22}{e['memory']['locked_bytes'] / 2**20:>10.0f}"
          f"{p['memory']['locked_bytes'] / 2**20:>10.0f}", file=sys.stderr)
    print(f"edge --help {result['cli']['help_s']:.3f} s; import edge.cli {result['cli']['import_edge_cli_s']:.3f} s; "
          f"raw read {result['cold_cache']['raw_read_mb_per_s']} MB/s", file=sys.stderr)
    for t, ok in targets.items():
        print(f"target {t}: {'met' if ok else 'MISSED'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
