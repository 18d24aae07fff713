"""KV-cache types against f16 on one model (the builtin Gemma 3 270M): what a quantized cache
costs in quality and gives or takes in decode speed (`type_k`/`type_v`, docs/performance.md).

Quality, on `--prompts` novel prompts (60 tokens each): f16 continues each greedily for
`--continuation` tokens; then every type computes that same text (teacher forcing, one decode
with a logits row per continuation token) and is compared with f16 row by row: the mean KL
divergence of its next-token distribution from f16's, the mean and largest |difference| of the
log-probability of f16's token, and how often its most likely token is f16's (llama.cpp's
`llama-perplexity --kl-divergence` measures the same against a base run).

Speed: with each type, a prompt of each `--contexts` length is prefilled, then `--decode` tokens
are decoded one at a time (greedy, no sampler: llama.cpp's decode alone), rounds alternating the
types' order; tokens/s, median over rounds. The KV state's bytes after the longest context come from
llama.cpp's own state size (Gemma 3 keeps only a window in its sliding-window layers). In process, through edge's llama.cpp layer (edge.model), the same settings as a
served model (flash attention "auto", which a quantized V turns on). Prints JSON (also
.bench/kvtypes.json) and a table; the load average is part of the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import emit, gemma_path, novel_prompts, summary
from edge.config import ModelConfig
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model


def load(path: Path, kind: str, n_ctx: int, threads: int) -> GGUFModel:
    cfg = ModelConfig(name=kind, path=str(path), n_ctx=n_ctx, n_threads=threads, parallel=1, type_k=kind,
                      type_v=kind, use_mlock=False)
    return load_gguf_model(cfg, read_gguf_info(path))


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def rows_for(m: GGUFModel, tokens: list[int], first: int) -> np.ndarray:
    """Log-probabilities after each of tokens[first-1:-1]: the rows predicting tokens[first:]."""
    n = m.native
    n.clear(0)
    out = [1 if i >= first - 1 and i < len(tokens) - 1 else 0 for i in range(len(tokens))]
    n.decode_batch(tokens, list(range(len(tokens))), [0] * len(tokens), out)
    idx = [i for i, o in enumerate(out) if o]
    return log_softmax(np.stack([np.array(n.logits(i)) for i in idx]))


def greedy(m: GGUFModel, prompt: list[int], n: int) -> list[int]:
    nat = m.native
    nat.clear(0)
    nat.decode(0, prompt, 0)
    out, pos = [], len(prompt)
    for _ in range(n):
        tok = int(np.argmax(nat.logits()))
        out.append(tok)
        nat.decode_one(0, tok, pos)
        pos += 1
    return out


def quality(models: dict[str, GGUFModel], prompts: list[str], continuation: int) -> dict[str, Any]:
    base = models["f16"]
    per: dict[str, list[tuple[float, float, bool]]] = {k: [] for k in models if k != "f16"}
    for text in prompts:
        prompt = base.tokenize_prompt(text)
        tokens = prompt + greedy(base, prompt, continuation)
        ref = rows_for(base, tokens, len(prompt))
        chosen = tokens[len(prompt):]
        for kind, m in models.items():
            if kind == "f16":
                continue
            got = rows_for(m, tokens, len(prompt))
            kl = (np.exp(ref) * (ref - got)).sum(axis=1)
            diff = np.abs(ref[np.arange(len(chosen)), chosen] - got[np.arange(len(chosen)), chosen])
            same = got.argmax(axis=1) == ref.argmax(axis=1)
            per[kind] += [(float(k), float(d), bool(s)) for k, d, s in zip(kl, diff, same)]
    return {kind: {"rows": len(rs), "mean_kl_divergence": round(statistics.fmean(r[0] for r in rs), 6),
                   "mean_abs_logprob_diff": round(statistics.fmean(r[1] for r in rs), 5),
                   "max_abs_logprob_diff": round(max(r[1] for r in rs), 4),
                   "top1_agreement": round(sum(r[2] for r in rs) / len(rs), 4)} for kind, rs in per.items()}


def decode_speed(models: dict[str, GGUFModel], prompt: list[int], n: int, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for kind in order:
            nat = models[kind].native
            nat.clear(0)
            nat.decode(0, prompt, 0)
            tok, pos = int(np.argmax(nat.logits())), len(prompt)
            t0 = time.perf_counter()
            for _ in range(n):
                nat.decode_one(0, tok, pos)
                tok, pos = int(np.argmax(nat.logits())), pos + 1
            times[kind].append(n / (time.perf_counter() - t0))
    return {k: {"tokens_per_s": round(statistics.median(v), 2), "rounds": summary(v),
                "vs_f16": round(statistics.median(v) / statistics.median(times["f16"]), 3)} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=["q8_0", "q4_0"], help="compared with f16")
    ap.add_argument("--prompts", type=int, default=50, help="0: decode speed only")
    ap.add_argument("--continuation", type=int, default=24, help="tokens f16 continues each prompt with")
    ap.add_argument("--contexts", type=int, nargs="*", default=[256, 1536], help="prompt lengths before the decode")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded per speed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.prompts < 0 or args.rounds < 1:
        ap.error("--prompts must be at least 0 and --rounds at least 1")

    path = gemma_path()
    n_ctx = max(max(args.contexts) + args.decode + 8, 512)
    load_before = os.getloadavg()
    models = {kind: load(path, kind, n_ctx, args.threads) for kind in ["f16", *args.types]}
    try:
        q = quality(models, novel_prompts(path, 60, list(range(1, args.prompts + 1))), args.continuation) \
            if args.prompts else {}
        long_text = " ".join(novel_prompts(path, 120, list(range(200, 200 + max(args.contexts) // 100 + 2))))
        long_tokens = models["f16"].tokenize_prompt(long_text)
        speed = {str(c): decode_speed(models, long_tokens[:c], args.decode, args.rounds) for c in sorted(args.contexts)}
        # after the longest context's last round: llama.cpp's own state of those cells, per type
        kv = {kind: m.native.state_size(0) for kind, m in models.items()}
    finally:
        for m in models.values():
            m.close()
    result = {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "n_ctx": n_ctx, "prompts": args.prompts,
              "continuation": args.continuation, "rounds": args.rounds, "cpus": os.cpu_count(),
              "kv_state_bytes": {"tokens": max(args.contexts) + args.decode, **kv}, "quality_vs_f16": q, "decode": speed,
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}}
    emit(result, "kvtypes")
    table(result)


def table(result: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\n{'type':>6}{'KV MiB':>9}{'mean KL':>10}{'mean |dlp|':>12}{'max |dlp|':>11}{'top-1 same':>12}", file=err)
    for kind, b in result["kv_state_bytes"].items():
        if kind == "tokens":
            continue
        qq = result["quality_vs_f16"].get(kind, {})
        print(f"{kind:>6}{b / 2**20:>9.1f}{qq.get('mean_kl_divergence', '-'):>10}{qq.get('mean_abs_logprob_diff', '-'):>12}"
              f"{qq.get('max_abs_logprob_diff', '-'):>11}{qq.get('top1_agreement', '-'):>12}", file=err)
    for ctx, row in result["decode"].items():
        print(f"decode after {ctx} tokens: " + ", ".join(f"{k} {v['tokens_per_s']} tok/s ({v['vs_f16']}x)"
                                                         for k, v in row.items()), file=err)
    print(f"load average {result['load_average']} ({result['cpus']} CPUs)", file=err)


if __name__ == "__main__":
    main()
