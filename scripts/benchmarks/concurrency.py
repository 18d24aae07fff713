"""Many clients at once: edge's continuous batching against llama.cpp's own `llama-server`, same GGUF
(the builtin Gemma 3 270M), same llama.cpp, same threads, in three configurations (rows):

- `defaults`: each server as a user gets it. edge with neither n_ctx nor parallel set (sized for
  the model and the device: edge.model.memory.context_plan) against `llama-server -m MODEL` with
  nothing but the thread counts (its `-c 0`: the model's trained context; `-np auto`: 4 slots,
  unified KV; its default batch sizes, mmap without mlock).
- `same`: the same KV size and slots for both (`--same-ctx`, `--same-slots`: edge `n_ctx`,
  `parallel`; llama-server `-c`, `-np`, `--kv-unified`), the same batch sizes.
- `small`: a small shared context (`--small-ctx` tokens for `--small-slots` slots), the same way.

A round: C clients at once (`--clients`, default 8), each sending PER_CLIENT novel completions
back to back (~120 prompt tokens, 48 generated, greedy, EOS and end-of-turn banned through
`logit_bias`, so every request generates exactly 48); the two servers of a row take turns, the
order alternating every round. No prompt is seen twice by a server, none by a warm-up. Per server
and row, over the rounds after the first (the first burst after READY): aggregate generated
tokens/s over the round's wall time (median of the rounds), request latency p50 and p95 (of every
request of those rounds), and the longest request against the median (a request waiting more
than its share shows there); and where edge's steps spent their time (its /metrics counters:
llama_decode, sampling, the rest), with the tokens and sequences per step. Ratios edge /
llama-server; targets (issue 51): tokens/s >= 1.0 at
the defaults (aim 1.1), >= 1.1 at the same configuration, >= 1.0 with the small context; p95 <=
llama-server's in every row. Prints JSON (also .bench/concurrency.json) and a table; reports,
never asserts. The load average is part of the result: on a shared machine, read the ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import (Peer, Started, edge_config, emit, env_for_bench, gemma_path, llama_server,
                               novel_prompts, start_edge, start_peer, summary)
from benchmarks.steady import banned_tokens, body, timed

PER_CLIENT = 3  # requests each client sends back to back
ROWS = ("defaults", "same", "small")
TARGETS = {"tokens_per_s": {"defaults": 1.0, "same": 1.1, "small": 1.0}, "p95_at_most": 1.0,
           "defaults_aim": 1.1}


def burst(s: Started, prompts: list[str], clients: int, bias: dict[str, float], tokens: int) -> dict[str, Any]:
    """`clients` at once, each PER_CLIENT requests in turn: aggregate tokens/s, every latency."""
    def client(mine: list[str]) -> list[tuple[float, int]]:
        return [timed(s.address, body(p, tokens, bias)) for p in mine]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, [prompts[i::clients] for i in range(clients)]) for r in rs]
    wall = time.perf_counter() - t0
    if any(n != tokens for _, n in done):
        raise RuntimeError(f"{s.name} generated {[n for _, n in done]} tokens, not {tokens} each (EOS not banned?)")
    return {"tokens_per_s": sum(n for _, n in done) / wall, "latencies_s": [t for t, _ in done],
            "wall_s": wall, "load1": os.getloadavg()[0]}


def edge_defaults(folder: Path, model: Path, threads: int) -> Path:
    """edge's config with nothing set for the model but its path and threads (no n_ctx, no
    parallel, no batch size); a warm-up without measured prompts."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{folder / "state"}"\ncache_dir = "{folder / "cache"}"\n'
                   f'[[models]]\nname = "gemma"\npath = "{model}"\nn_threads = {threads}\n'
                   f'[warmup]\nprompts = []\n')
    return cfg


def llama_server_defaults(binary: Path, model: Path, threads: int) -> Peer:
    """`llama-server -m MODEL` with the thread counts and nothing else."""
    def argv(port: int | str) -> list[str]:
        return [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(threads), "--threads-batch", str(threads)]
    return Peer("llama-server", argv, "/health")


def configs(row: str, args: argparse.Namespace, model: Path, tmp: Path) -> tuple[Path, Peer, dict[str, Any]]:
    """(edge's config, llama-server, what the row sets) of one row."""
    if row == "defaults":
        return (edge_defaults(tmp / row, model, args.threads),
                llama_server_defaults(args.llama_server, model, args.threads), {"set": "threads only"})
    n_ctx, slots = (args.same_ctx, args.same_slots) if row == "same" else (args.small_ctx, args.small_slots)
    cfg = edge_config(tmp / row, model, n_ctx, n_threads=args.threads, extra_model=f"parallel = {slots}\n")
    return cfg, llama_server(args.llama_server, model, n_ctx, args.threads, parallel=slots), {
        "n_ctx": n_ctx, "slots": slots}


def run_row(row: str, args: argparse.Namespace, model: Path, bias: dict[str, float], prompts: list[str],
            tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Both servers of a row up, rounds alternating; per server the rounds' results."""
    cfg, peer, _ = configs(row, args, model, tmp)
    rounds: dict[str, list[dict[str, Any]]] = {"edge": [], "llama-server": []}
    n = args.clients * PER_CLIENT
    with ExitStack() as stack:
        servers = {"edge": stack.enter_context(start_edge(cfg, env_for_bench())),
                   "llama-server": stack.enter_context(start_peer(peer, tmp / f"llama-server-{row}.log"))}
        for s in servers.values():
            s.ready_at()
        split0 = split(servers["edge"].address)
        for r in range(args.rounds):
            mine = prompts[r * n:(r + 1) * n]  # the same novel prompts for both, once each
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                rounds[name].append(burst(servers[name], mine, args.clients, bias, args.max_tokens))
        edge_context = report_context(cfg)
        step_split = split(servers["edge"].address, split0)
    return {**rounds, "edge_context": edge_context, "edge_steps": step_split}


SPLIT = ("step", "decode", "sample")


def split(address: tuple[str, int], since: dict[str, float] | None = None) -> dict[str, float]:
    """edge's step counters (/metrics); with `since`, what the rounds added and the split of a
    step: llama_decode, sampling, the rest (batch, admission) in percent, batch size per step."""
    from harness import metric

    now = {k: metric(address, f"edge_batch_{k}_seconds_total", model="gemma") for k in SPLIT}
    now.update({k: metric(address, f"edge_batch_{k}_total", model="gemma") for k in ("steps", "tokens", "sequences")})
    if since is None:
        return now
    d = {k: now[k] - since[k] for k in now}
    step = d["step"] or 1.0
    return {"steps": int(d["steps"]), "step_ms": round(1000 * d["step"] / max(1, d["steps"]), 2),
            "decode_pct": round(100 * d["decode"] / step, 1), "sample_pct": round(100 * d["sample"] / step, 1),
            "other_pct": round(100 * (d["step"] - d["decode"] - d["sample"]) / step, 1),
            "tokens_per_step": round(d["tokens"] / max(1, d["steps"]), 2),
            "sequences_per_step": round(d["sequences"] / max(1, d["steps"]), 2)}


def report_context(cfg: Path) -> dict[str, Any]:
    """The context and slots edge's start report says it made (n_ctx, parallel and why)."""
    try:
        report = json.loads((cfg.parent / "state" / "last-start.json").read_text())
        model = (report.get("models") or [{}])[0]
        c = model.get("context") or {}
        return {"n_ctx": model.get("n_ctx"), "parallel": c.get("parallel"), "n_ctx_why": c.get("n_ctx_why"),
                "parallel_why": c.get("parallel_why")}
    except (OSError, ValueError):
        return {}


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the rounds after the first: tokens/s (median of rounds), latency p50/p95/longest of every
    request, the longest over the median."""
    from edge.serve.bench import percentile

    later = rounds[1:]
    lat = [t for r in later for t in r["latencies_s"]]
    p50 = percentile(lat, 0.50)
    return {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in later), 2),
            "p50_s": round(p50, 3), "p95_s": round(percentile(lat, 0.95), 3), "longest_s": round(max(lat), 3),
            "longest_over_p50": round(max(lat) / p50, 2) if p50 else None,
            "first_burst_wall_s": round(rounds[0]["wall_s"], 3),
            "first_burst_over_later": round(rounds[0]["wall_s"] / statistics.median(r["wall_s"] for r in later), 3),
            "rounds": {k: summary([r[k] for r in later]) for k in ("tokens_per_s", "wall_s")}}


def ratios(edge: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    return {k: round(edge[k] / peer[k], 3) for k in ("tokens_per_s", "p50_s", "p95_s", "longest_s") if peer[k]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="per row; the first is the first burst")
    ap.add_argument("--rows", nargs="*", choices=ROWS, default=list(ROWS))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--same-ctx", type=int, default=16384, help="the `same` row's n_ctx (both servers)")
    ap.add_argument("--same-slots", type=int, default=8)
    ap.add_argument("--small-ctx", type=int, default=2048, help="the `small` row's n_ctx (both servers)")
    ap.add_argument("--small-slots", type=int, default=8)
    ap.add_argument("--llama-server", type=Path, required=True, help="llama-server binary (scripts/build-llama-server)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first burst, and a later one to compare it with)")

    model = gemma_path()
    bias = banned_tokens(model)
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-concurrency-"))
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    seed = 1
    for row in args.rows:
        n = args.rounds * args.clients * PER_CLIENT
        prompts = novel_prompts(model, args.prompt_tokens, list(range(seed, seed + n)))
        seed += n
        got = run_row(row, args, model, bias, prompts, tmp)
        edge, peer = aggregate(got["edge"]), aggregate(got["llama-server"])
        _, server, sets = configs(row, args, model, tmp)
        rows[row] = {"sets": sets, "edge_context": got["edge_context"], "edge_steps": got["edge_steps"],
                     "llama_server_argv": server.argv("PORT"),
                     "edge": edge, "llama-server": peer, "ratios_edge_over_llama_server": ratios(edge, peer)}
    result = {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "clients": args.clients,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "per_client": PER_CLIENT,
              "rounds": args.rounds, "cpus": os.cpu_count(),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]},
              "targets": TARGETS, "rows": rows}
    emit(result, "concurrency")
    table(result)


def table(result: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\n{'row':>9}{'edge tok/s':>12}{'l-s tok/s':>11}{'ratio':>7}{'p50 e/l':>15}{'p95 e/l':>15}"
          f"{'longest e/l':>15}{'longest/p50 e/l':>17}", file=err)
    for name, row in result["rows"].items():
        e, p, r = row["edge"], row["llama-server"], row["ratios_edge_over_llama_server"]
        print(f"{name:>9}{e['tokens_per_s']:>12}{p['tokens_per_s']:>11}{r['tokens_per_s']:>7}"
              f"{e['p50_s']:>8}/{p['p50_s']:<6}{e['p95_s']:>8}/{p['p95_s']:<6}{e['longest_s']:>8}/{p['longest_s']:<6}"
              f"{e['longest_over_p50']:>9}/{p['longest_over_p50']:<7}", file=err)
    for name, row in result["rows"].items():
        print(f"{name}: edge {row['edge_context']}; llama-server {' '.join(map(str, row['llama_server_argv'][1:]))}",
              file=err)
        print(f"{name}: edge's steps {row['edge_steps']}", file=err)
    print(f"load average {result['load_average']} ({result['cpus']} CPUs)", file=err)


if __name__ == "__main__":
    main()
