"""A grammar's cost stays its own (issue 56 item 8): a plain stream's ms/token beside 4 clients
under the heaviest grammar edge accepts, against beside 4 plain clients, on the real Gemma 3 270M
with `parallel = 5`.

Per round, 4 neighbours start streaming and keep the other slots busy (each sends its next request
as soon as one ends): either plain completions (EOS banned) or chats whose
`response_format` is the heaviest schema edge accepts (an array of an anyOf of 128 look-alike
objects: 256 grammar stacks, MAX_STACKS; temperature 1, so the grammar goes over every candidate
for the tokens it rejects); both kinds at temperature 1 with the same sampling chain, so that
what differs is the grammar. Once every neighbour has its first token, the measured client streams a
novel plain completion (greedy, EOS banned, `--tokens` tokens); its ms/token is the time from its
first token to its last over the tokens between. The neighbours' kind alternates every round.
Prints JSON (also .bench/grammar-share.json) and a table: the medians, and heavy / plain (the bound
edge states: a step is stretched by at most GRAMMAR_SHARE of its decode, one chunk, and each
grammar sequence's one-token check and accept: about 1.25x). `--edge-src DIR` runs the edge of another checkout (its `edge/` first on
PYTHONPATH), to measure the same rows before the change. Run as `scripts/bench grammar_share`.
Reports, never asserts; the load average is part of the result.
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

from benchmarks.common import edge_config, emit, env_for_bench, gemma_path, novel_prompts, start_edge, summary
from benchmarks.steady import banned_tokens

NEIGHBOURS = 4
KEYS = [f"{chr(97 + i % 26)}{i:03d}" for i in range(128)]
HEAVY = {"type": "array", "minItems": 1000, "items": {"anyOf": [
    {"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in KEYS]}}
# Gemma 3's turn format (the embedded GGUF carries no template; bench_steady sets the same)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>user\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}<start_of_turn>model\n")


def stream(address: tuple[str, int], path: str, body: dict[str, Any], first: threading.Event | None = None,
           stop: threading.Event | None = None) -> list[float]:
    """The arrival time of each server-sent event with text, until [DONE] (or `stop`: the
    connection is closed, and edge ends the sequence at its next step)."""
    c = http.client.HTTPConnection(*address, timeout=600)
    try:
        c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        times = []
        while (line := r.readline()) and not line.startswith(b"data: [DONE]"):
            if line.startswith(b"data: {") and b'"error"' in line:
                raise RuntimeError(line.decode()[:300])
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                if first is not None:
                    first.set()
            if stop is not None and stop.is_set():
                break
        return times
    finally:
        c.close()


def neighbour(address: tuple[str, int], heavy: bool, bias: dict[str, float], first: threading.Event,
              stop: threading.Event, errors: list[str]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        if heavy:
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "List the records as JSON."}], "max_tokens": 600,
                "temperature": 1.0, "seed": n, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "records", "schema": HEAVY}}}
        else:
            path, body = "/v1/completions", {"prompt": f"Story {n}: once upon a time", "max_tokens": 600,
                                             "temperature": 1.0, "seed": n, "logit_bias": bias}
        try:
            stream(address, path, body, first, stop)
        except (OSError, RuntimeError) as exc:
            errors.append(str(exc))
            return


def one_round(address: tuple[str, int], heavy: bool, prompt: str, tokens: int, bias: dict[str, float]) -> float:
    """The measured stream's ms/token beside NEIGHBOURS neighbours of one kind."""
    stop, errors = threading.Event(), []
    firsts = [threading.Event() for _ in range(NEIGHBOURS)]
    threads = [threading.Thread(target=neighbour, args=(address, heavy, bias, f, stop, errors)) for f in firsts]
    for t in threads:
        t.start()
    try:
        for f in firsts:
            if not f.wait(300):
                raise RuntimeError(f"a neighbour did not start: {errors}")
        times = stream(address, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                                    "logit_bias": bias})
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    if errors:
        raise RuntimeError(f"neighbours failed: {errors[:2]}")
    if len(times) < 2:
        raise RuntimeError("the measured stream sent fewer than two events")
    return 1000 * (times[-1] - times[0]) / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per neighbour kind")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream")
    ap.add_argument("--threads", type=int, default=0, help="n_threads (0: edge's default)")
    ap.add_argument("--edge-src", type=Path, default=None, help="a checkout whose edge/ to run instead")
    args = ap.parse_args()
    model = gemma_path()
    bias = banned_tokens(model)
    prompts = novel_prompts(model, 32, list(range(1, 2 * args.rounds + 1)))
    env = env_for_bench()
    if args.edge_src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(args.edge_src.resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    rows: dict[str, list[float]] = {"plain": [], "heavy": []}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = edge_config(Path(tmp), model, 8192, n_threads=args.threads,
                          extra_model=f"parallel = {NEIGHBOURS + 1}\nchat_template = {json.dumps(TEMPLATE)}\n")
        with start_edge(cfg, env) as s:
            s.ready_at()
            for r in range(2 * args.rounds):
                kind = ("plain", "heavy")[(r + r // 2) % 2]  # plain, heavy, heavy, plain, ...
                rows[kind].append(one_round(s.address, kind == "heavy", prompts[r], args.tokens, bias))
                print(f"round {r}: beside 4 {kind}: {rows[kind][-1]:.1f} ms/token", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"ms_per_token_beside_plain": summary(rows["plain"]), "ms_per_token_beside_heavy": summary(rows["heavy"]),
              "heavy_over_plain": round(med["heavy"] / med["plain"], 3), "tokens": args.tokens,
              "edge_src": str(args.edge_src) if args.edge_src else "this checkout", "load1": os.getloadavg()[0]}
    emit(result, "grammar-share")
    print(f"plain stream beside 4 plain: {med['plain']:.1f} ms/token, beside 4 heavy-grammar: {med['heavy']:.1f} "
          f"ms/token ({result['heavy_over_plain']}x); load average {result['load1']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
