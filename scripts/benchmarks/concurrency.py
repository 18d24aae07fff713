"""Many clients at once: edge's continuous batching against llama.cpp's own `llama-server -np C`,
same GGUF (the builtin Gemma 3 270M), same llama.cpp, same threads, n_ctx and batch.

For C = 1, 4 and 8 clients both servers are started with C slots (edge `parallel = C`,
llama-server `--parallel C --kv-unified`). A round: C clients at once, each sending 3 novel
completions back to back (~120 prompt tokens, 48 generated, greedy, EOS and end-of-turn banned
through `logit_bias`, so every request generates exactly 48); the servers take turns, the order
alternating every round. No prompt is seen twice by a server, none by a warm-up. Per server and
C: aggregate generated tokens/s over the round's wall time and the p50 request latency, medians
over the rounds after the first; the first round (the first burst after READY) over the later
ones' median is edge's warm-up check (target <= 1.05). Ratios edge / llama-server: tokens/s
(targets >= 1.0 at 4 and 8 clients), p50 (<= 1.0 at 8), 1 client's per-token time (<= 1.03).
Prints JSON (also .bench/concurrency.json) and a table; reports, never asserts. The load
average is part of the result: on a shared machine, read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from benchmarks.steady import banned_tokens, body, timed
from benchmarks.common import (Started, edge_config, emit, env_for_bench, gemma_path, llama_server,
                      novel_prompts, start_edge, start_peer, summary)

PER_CLIENT = 3  # requests each client sends back to back
TARGETS = {"tokens_per_s_8": 1.0, "tokens_per_s_4": 1.0, "p50_8": 1.0, "decode_1": 1.03, "first_burst": 1.05}


def burst(s: Started, prompts: list[str], clients: int, bias: dict[str, float], tokens: int) -> dict[str, Any]:
    """`clients` at once, each PER_CLIENT requests in turn: aggregate tokens/s, latencies."""
    def client(mine: list[str]) -> list[tuple[float, int]]:
        return [timed(s.address, body(p, tokens, bias)) for p in mine]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, [prompts[i::clients] for i in range(clients)]) for r in rs]
    wall = time.perf_counter() - t0
    if any(n != tokens for _, n in done):
        raise RuntimeError(f"{s.name} generated {[n for _, n in done]} tokens, not {tokens} each (EOS not banned?)")
    return {"tokens_per_s": sum(n for _, n in done) / wall, "p50_s": statistics.median(t for t, _ in done),
            "wall_s": wall, "load1": os.getloadavg()[0]}


def run_clients(clients: int, args: argparse.Namespace, model: Path, bias: dict[str, float],
                prompts: list[str], tmp: Path) -> dict[str, Any]:
    """Both servers up with `clients` slots, rounds alternating; per server the rounds' results."""
    from contextlib import ExitStack

    cfg = edge_config(tmp / f"edge-{clients}", model, args.n_ctx, n_threads=args.threads,
                      extra_model=f"parallel = {clients}\n")
    peer = llama_server(args.llama_server, model, args.n_ctx, args.threads, parallel=clients)
    rounds: dict[str, list[dict[str, Any]]] = {"edge": [], "llama-server": []}
    n = clients * PER_CLIENT
    with ExitStack() as stack:
        servers = {"edge": stack.enter_context(start_edge(cfg, env_for_bench())),
                   "llama-server": stack.enter_context(start_peer(peer, tmp / f"llama-server-{clients}.log"))}
        for s in servers.values():
            s.ready_at()
        for r in range(args.rounds):
            mine = prompts[r * n:(r + 1) * n]  # the same novel prompts for both, once each
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                rounds[name].append(burst(servers[name], mine, clients, bias, args.max_tokens))
    return rounds


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    later = rounds[1:]
    tps = statistics.median(r["tokens_per_s"] for r in later)
    return {"tokens_per_s": round(tps, 2), "p50_s": round(statistics.median(r["p50_s"] for r in later), 3),
            "first_burst_wall_s": round(rounds[0]["wall_s"], 3),
            "first_burst_over_later": round(rounds[0]["wall_s"] / statistics.median(r["wall_s"] for r in later), 3),
            "rounds": {k: summary([r[k] for r in later]) for k in ("tokens_per_s", "p50_s", "wall_s")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="per client count; the first is the first burst")
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--prompt-tokens", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--llama-server", type=Path, required=True, help="llama-server binary (scripts/build-llama-server)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first burst, and a later one to compare it with)")

    model = gemma_path()
    bias = banned_tokens(model)
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-concurrency-"))
    load_before = os.getloadavg()
    per_c: dict[str, Any] = {}
    seed = 1
    for clients in args.clients:
        n = args.rounds * clients * PER_CLIENT
        prompts = novel_prompts(model, args.prompt_tokens, list(range(seed, seed + n)))
        seed += n
        rounds = run_clients(clients, args, model, bias, prompts, tmp)
        edge, peer = aggregate(rounds["edge"]), aggregate(rounds["llama-server"])
        per_c[str(clients)] = {"edge": edge, "llama-server": peer, "ratios_edge_over_llama_server": {
            "tokens_per_s": round(edge["tokens_per_s"] / peer["tokens_per_s"], 3),
            "p50_s": round(edge["p50_s"] / peer["p50_s"], 3)}}
    result = {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "n_ctx": args.n_ctx,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "per_client": PER_CLIENT,
              "rounds": args.rounds, "cpus": os.cpu_count(),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]},
              "targets": TARGETS, "clients": per_c}
    emit(result, "concurrency")
    table(result)


def table(result: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\n{'clients':>8}{'edge tok/s':>12}{'llama-server':>14}{'ratio':>8}{'edge p50':>10}"
          f"{'their p50':>11}{'ratio':>8}{'edge 1st/later':>16}", file=err)
    for c, row in result["clients"].items():
        e, p, r = row["edge"], row["llama-server"], row["ratios_edge_over_llama_server"]
        print(f"{c:>8}{e['tokens_per_s']:>12}{p['tokens_per_s']:>14}{r['tokens_per_s']:>8}{e['p50_s']:>10}"
              f"{p['p50_s']:>11}{r['p50_s']:>8}{e['first_burst_over_later']:>16}", file=err)
    print(f"load average {result['load_average']} ({result['cpus']} CPUs)", file=err)


if __name__ == "__main__":
    main()
