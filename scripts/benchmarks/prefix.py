"""A deployment's long prefix, kept warm: edge vs llama.cpp's `llama-server` and llama-cpp-python's
server on the same model and llama.cpp, in one run.

Every request is a fixed ~1,000-token prefix (a system prompt, say) plus a short question no
request asked before, `max_tokens = 1`, greedy: its time is the time to first token. Per round,
in an order that rotates every round, each server is started and asked:
- first: the first request after ready;
- next: the next request with the same prefix;
- after_unrelated: the same prefix after one unrelated (novel, ~100-token) request;
- after_restart: the first request after a restart (stop, start, ready);
edge twice: with the prefix declared in its config (`[[models.prefixes]]`, its state restored from
disk at every start) and with `learn_prefixes` only (saved at SIGTERM from what traffic reused);
and edge's first request after a zero-gap reload. Also edge's ready time with and without the
declared prefix (case `kept`). Cases `rotation` (2 and 3 undeclared prefixes in turns) and `chat`
(chats re-sent with a growing history) compare edge with llama-server: scripts/turns.py.
Prints JSON (also .bench/prefix.json) and a table with the ratios; targets are reported, never
asserted: after an unrelated request <= 1.0x llama-server; after a restart or reload <= 0.1x
llama-server's and <= 1.5x edge's own next request; ready with restored prefixes <= ready
without + 5%; the rotation's and chat's in scripts/turns.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any


from benchmarks import turns
from benchmarks.common import (EDGE, Peer, Started, edge_config, emit, env_for_bench, gemma_path,
                      llama_cpp_server, llama_server, novel_prompts, start_edge, start_peer, summary)
from edge.serve.client import request as http

STEPS = ("first", "next", "after_unrelated", "after_restart")
CASES = ("kept", "rotation", "chat")


def ttft(address: tuple[str, int], prompt: str) -> float:
    t0 = time.perf_counter()
    status, payload = http(address, "POST", "/v1/completions",
                           {"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=600)
    took = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {address}: {payload[:300]!r}")
    return took


class Texts:
    """The prefix, and novel questions and unrelated prompts (each used once)."""

    def __init__(self, model: Path, prefix_tokens: int, n: int) -> None:
        seeds = iter(range(1, 10_000))
        (self.prefix,) = novel_prompts(model, prefix_tokens, [next(seeds)])
        self.questions = [" " + q for q in novel_prompts(model, 24, [next(seeds) for _ in range(n)])]
        self.unrelated = novel_prompts(model, 100, [next(seeds) for _ in range(n)])

    def question(self) -> str:
        return self.prefix + self.questions.pop()


def edge_cfg(folder: Path, model: Path, n_ctx: int, threads: int, mode: str, prefix: str) -> Path:
    cfg = edge_config(folder, model, n_ctx, n_threads=threads)
    extra = {"declared": f'[[models.prefixes]]\nname = "system"\ntext = {json.dumps(prefix)}\n',
             "learned": "learn_prefixes = 2\n", "none": ""}[mode]
    text = cfg.read_text().replace("[warmup]", extra + "[warmup]")
    cfg.write_text(text)
    return cfg


def session(launch: Callable[[], AbstractContextManager[Started]], texts: Texts,
            reload_cfg: Path | None = None) -> dict[str, float]:
    """One contender's steps: a start, three requests, an unrelated one, a restart."""
    out: dict[str, float] = {}
    with launch() as s:
        out["ready_s"] = s.ready_s()
        out["first"] = ttft(s.address, texts.question())
        out["next"] = ttft(s.address, texts.question())
        ttft(s.address, texts.unrelated.pop())
        out["after_unrelated"] = ttft(s.address, texts.question())
        if reload_cfg is not None:
            done = subprocess.run([*EDGE, "reload", "--config", str(reload_cfg)], capture_output=True,
                                  text=True, timeout=600, env=env_for_bench())
            if done.returncode != 0:
                raise RuntimeError(f"edge reload failed: {done.stderr[-500:]}")
            out["after_reload"] = ttft(s.address, texts.question())
    with launch() as s:
        out["restart_ready_s"] = s.ready_s()
        out["after_restart"] = ttft(s.address, texts.question())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)} (kept: the steps above; rotation and chat: "
                         "scripts/turns.py, edge and llama-server only)")
    ap.add_argument("--rotation-tokens", type=int, default=800, help="each rotating prefix's tokens")
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--llama-server-skipped", default="")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if not cases or set(cases) - set(CASES):
        ap.error(f"--cases: expected a comma-separated list of {', '.join(CASES)}, got {args.cases!r}")

    model = gemma_path()
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-prefix-"))
    result = kept(args, model, tmp) if "kept" in cases else {
        "model": "gemma3-270m Q4_K_M", "threads": args.threads, "n_ctx": args.n_ctx, "rounds": args.rounds,
        "cpus": os.cpu_count(), "llama_server_skipped": args.llama_server_skipped or None}
    turn_cases = [c for case in cases if case != "kept" for c in turns.CASES[case]]
    if turn_cases:
        result["turns"] = turns(args, model, tmp, turn_cases)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    emit(result, "prefix")
    if "kept" in cases:
        table(result)
    if turn_cases:
        turns.table(result["turns"]["summary"], sys.stderr)
        print(f"load average {result['load_average']}", file=sys.stderr)


def kept(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    """A long prefix across unrelated requests, restarts and reloads, every server."""
    texts = Texts(model, args.prefix_tokens, 20 * args.rounds + 8)  # 5 questions per server and round
    cfgs = {mode: edge_cfg(tmp / f"edge-{mode}", model, args.n_ctx, args.threads, mode, texts.prefix)
            for mode in ("declared", "learned", "none")}
    # a reload target: the same service (paths), another n_ctx: a new set, the model loaded again
    reload_cfg = cfgs["declared"].with_name("reload.toml")
    reload_cfg.write_text(cfgs["declared"].read_text().replace(f"n_ctx = {args.n_ctx}\n",
                                                               f"n_ctx = {args.n_ctx - 256}\n"))
    launchers: dict[str, tuple[Callable[[], AbstractContextManager[Started]], Path | None]] = {
        "edge (declared)": (lambda: start_edge(cfgs["declared"], env_for_bench()), reload_cfg),
        "edge (learned)": (lambda: start_edge(cfgs["learned"], env_for_bench()), None),
    }
    peers = [llama_cpp_server(model, args.n_ctx, args.threads)]
    if args.llama_server:
        peers.append(llama_server(args.llama_server, model, args.n_ctx, args.threads))
    for peer in peers:
        launchers[peer.name] = ((lambda peer=peer: start_peer(peer, tmp / f"{peer.name}.log")), None)
    names = list(launchers)
    runs: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    ready: dict[str, list[float]] = {"with_prefix": [], "without": []}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            launch, reload_to = launchers[n]
            for k, v in session(launch, texts, reload_to).items():
                runs[n].setdefault(k, []).append(v)
        for key, mode in (("without", "none"), ("with_prefix", "declared"))[::1 if r % 2 else -1]:
            with start_edge(cfgs[mode], env_for_bench()) as s:
                ready[key].append(s.ready_s())
    return report(runs, ready, args, os.getloadavg())


def turns(args: argparse.Namespace, model: Path, tmp: Path, cases: list[str]) -> dict[str, Any]:
    """Prefixes in turns and chats (scripts/turns.py): edge with no declared prefix and
    its built-in Gemma chat template, llama-server with its default cache flags and that template."""
    from edge.builtin_models import GEMMA_TEMPLATE
    from harness import metric

    template = tmp / "gemma-template.jinja"
    template.write_text(GEMMA_TEMPLATE)
    cfg = edge_config(tmp / "edge-turns", model, args.n_ctx, n_threads=args.threads)
    cfg.write_text(cfg.read_text().replace("[warmup]", f"chat_template = {json.dumps(GEMMA_TEMPLATE)}\n[warmup]"))
    launchers: dict[str, turns.Launch] = {"edge": lambda: start_edge(cfg, env_for_bench())}
    if args.llama_server:
        base = llama_server(args.llama_server, model, args.n_ctx, args.threads)
        peer = Peer(base.name, lambda port: [*base.argv(port), "--jinja", "--chat-template-file", str(template)],
                    base.ready_path)
        launchers[peer.name] = lambda: start_peer(peer, tmp / "llama-server-turns.log")
        argv = peer.argv("PORT")
    else:
        argv = []

    def cache_bytes(s: Started) -> dict[str, float]:
        return {"cache_bytes": metric(s.address, "edge_prompt_cache_bytes", model="gemma"),
                "cache_limit_bytes": metric(s.address, "edge_prompt_cache_limit_bytes", model="gemma")}

    texts = turns.Texts(model, args.rotation_tokens, args.rounds)
    out = turns.run(launchers, texts, args.rounds, cases, cache_bytes)
    return {"cases": cases, "rotation_tokens": args.rotation_tokens, "llama_server_argv": argv,
            "edge_config": cfg.read_text(), **out}


def report(runs: dict[str, dict[str, list[float]]], ready: dict[str, list[float]], args: argparse.Namespace,
           load: tuple[float, float, float]) -> dict[str, Any]:
    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in runs.items()}
    peer = med.get("llama-server")
    ratios: dict[str, Any] = {}
    for who in ("edge (declared)", "edge (learned)"):
        e = med[who]
        r = {"after_restart_over_own_next": round(e["after_restart"] / e["next"], 3)}
        if "after_reload" in e:
            r["after_reload_over_own_next"] = round(e["after_reload"] / e["next"], 3)
        for p in [n for n in med if not n.startswith("edge")]:
            for k in ("first", "next", "after_unrelated", "after_restart"):
                r[f"{k}_over_{p}"] = round(e[k] / med[p][k], 3)
            if "after_reload" in e:
                r[f"after_reload_over_{p}_after_restart"] = round(e["after_reload"] / med[p]["after_restart"], 3)
        ratios[who] = r
    ready_ratio = round(statistics.median(ready["with_prefix"]) / statistics.median(ready["without"]), 3)
    return {"model": "gemma3-270m Q4_K_M", "prefix_tokens": args.prefix_tokens, "threads": args.threads,
            "n_ctx": args.n_ctx, "rounds": args.rounds, "load_average": [round(x, 2) for x in load],
            "cpus": os.cpu_count(), "llama_server_skipped": args.llama_server_skipped or None,
            "servers": {n: {k: summary(v) for k, v in m.items()} for n, m in runs.items()},
            "ratios": ratios, "edge_ready_s": {k: summary(v) for k, v in ready.items()},
            "edge_ready_with_prefix_over_without": ready_ratio,
            "targets": {"after_unrelated_over_llama-server": 1.0, "after_restart_over_llama-server": 0.1,
                        "after_restart_over_own_next": 1.5, "ready_with_prefix_over_without": 1.05},
            "peer_reference": bool(peer)}


def table(result: dict[str, Any]) -> None:
    err, servers = sys.stderr, result["servers"]
    keys = [*STEPS, "after_reload", "ready_s"]
    print(f"\n{'median seconds':18}" + "".join(f"{n:>19}" for n in servers), file=err)
    for k in keys:
        cells = [f"{servers[n][k]['median']:>19.3f}" if k in servers[n] else f"{'-':>19}" for n in servers]
        print(f"{k:18}" + "".join(cells), file=err)
    for who, r in result["ratios"].items():
        print(f"{who}: " + ", ".join(f"{k} {v}" for k, v in r.items()), file=err)
    print(f"edge ready with the declared prefix / without: {result['edge_ready_with_prefix_over_without']}",
          file=err)
    print(f"load average {result['load_average']}", file=err)


if __name__ == "__main__":
    main()
