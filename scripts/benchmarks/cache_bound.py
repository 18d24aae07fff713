"""The prompt cache's bound on the real Gemma 3 270M Q4_K_M: how far a greedy answer continued from
a cached prefix strays from the same prompt computed fresh (`cache_prompt: false`).

Per prompt (a prefix of P tokens and a 24-token question no prompt shares): the cache is cleared,
the prefix alone is asked (max_tokens 1), so its KV state is in the cache; then prefix + question
is answered greedily for 12 tokens with the cache (the prefix reused, only the question prefilled)
and without it (the whole prompt from position 0, in llama.cpp's batches of n_batch). Both answers
carry the 5 likeliest tokens' logprobs at every step. Compared at each step up to and including
the first where the two answers part (past it their contexts differ): the absolute difference of
the fresh answer's token's logprob, as each run gave it. Where the answers part, the gap between
the fresh run's two likeliest tokens there is recorded (a near-tie decides the text).

Prompts: P in --prefix-tokens (several lengths: one batch, several, past the 512-token sliding
window of Gemma 3), half of them word lists (as the other benchmarks' novel prompts), half
sentences. Numerical, not a timing: the machine's load changes nothing measured (printed anyway).
Prints JSON (also .bench/cache-bound.json) and the sentence of docs/api.md ("Reproducibility")
made from it on stderr; `--record FILE` also writes the JSON there (tests/fixtures/cache_bound.json
holds that statement: tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any


from benchmarks.common import WORDS, emit, gemma_path

if TYPE_CHECKING:  # the model's modules load llama.cpp: imported where a measurement runs, so that
    # tests/test_docs.py can check docs/api.md against a recorded result without them
    from edge.model.generate import Piece
    from edge.model.llm import GGUFModel

QUESTION_TOKENS = 24
DECODE = 12
TOP = 5
SUBJECTS = ("the baker", "our river", "a small engine", "the old castle", "my teacher", "the harbor",
            "this winter", "the market", "a quiet village", "the red rocket", "her garden", "the storm")
VERBS = ("opens", "moves", "carries", "waits for", "remembers", "builds", "sells", "follows",
         "paints", "watches", "cleans", "finds")
OBJECTS = ("fresh bread", "the morning light", "two heavy boxes", "a silver ticket", "the last train",
           "warm coffee", "seven windows", "the blue door", "every letter", "a paper boat")
TAILS = ("before noon", "after the rain", "on Saturdays", "twice a day", "when it is cold",
         "without a sound", "near the bridge", "for the farmer")


def sentences(rng: random.Random, n: int) -> str:
    return " ".join(f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                    f"{rng.choice(TAILS)}." for _ in range(n))


def prompt_tokens(m: GGUFModel, kind: str, seed: int, prefix: int) -> tuple[list[int], list[int]]:
    """A prefix of exactly `prefix` tokens (BOS included) and a question of QUESTION_TOKENS."""
    rng = random.Random(seed)
    if kind == "words":
        body = " ".join(rng.choice(WORDS) for _ in range(prefix + 8))
        ask = " ".join(rng.choice(WORDS) for _ in range(QUESTION_TOKENS + 8))
    else:
        body = sentences(rng, prefix // 6 + 4)
        ask = f"\nQuestion: what does {rng.choice(SUBJECTS)} do {rng.choice(TAILS)}? " + sentences(rng, 4)
    head = m.tokenize_prompt(body)[:prefix]
    question = m.tokenize_text(" " + ask)[:QUESTION_TOKENS]
    if len(head) != prefix or len(question) != QUESTION_TOKENS:
        raise ValueError(f"seed {seed}: a {kind} prompt too short for {prefix} + {QUESTION_TOKENS} tokens")
    return head, question


def answer(m: GGUFModel, tokens: list[int], cache_prompt: bool, max_tokens: int = DECODE) -> tuple[list[Piece], int]:
    from edge.model.generate import GenParams, Job

    job = Job(tokens=tokens, params=GenParams(max_tokens=max_tokens, temperature=0, logprobs=TOP),
              cache_prompt=cache_prompt)
    pieces = list(m.generate(job))
    return pieces, job.cached_tokens


def compare(cached: list[Piece], fresh: list[Piece]) -> dict[str, Any]:
    """Per step, |logprob of the fresh answer's token, cached - fresh|, up to where they part."""
    a = [lp for p in cached for lp in p.logprobs]
    b = [lp for p in fresh for lp in p.logprobs]
    diffs: list[float] = []
    parted_at, gap = None, None
    for i, (x, y) in enumerate(zip(a, b)):
        other = dict(x.top).get(y.token)
        if other is not None:
            diffs.append(abs(other - y.logprob))
        if x.token != y.token:
            parted_at = i + 1
            ranked = sorted((lp for _, lp in y.top), reverse=True)
            gap = ranked[0] - ranked[1] if len(ranked) > 1 else None
            break
    return {"first": diffs[0] if diffs else None, "max": max(diffs) if diffs else None, "compared": len(diffs),
            "parted_at": parted_at, "gap": gap, "cached_text": "".join(p.text for p in cached),
            "fresh_text": "".join(p.text for p in fresh)}


def measure(m: GGUFModel, kind: str, seed: int, prefix: int) -> dict[str, Any]:
    head, question = prompt_tokens(m, kind, seed, prefix)
    m.cache.clear()
    m.slots.forget()
    answer(m, head, True, max_tokens=1)  # the prefix's state, as an earlier request leaves it
    cached, reused = answer(m, head + question, True)
    fresh, none = answer(m, head + question, False)
    if reused < prefix - 1 or none != 0:
        raise RuntimeError(f"seed {seed}: the cache reused {reused} of {prefix} prefix tokens, fresh {none}")
    return {"kind": kind, "seed": seed, "prefix_tokens": prefix, "reused": reused, **compare(cached, fresh)}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def dist(key: str) -> dict[str, float]:
        vals = [r[key] for r in rows if r[key] is not None]
        return {f"p{q}": round(pct(vals, q), 3) for q in (50, 90, 95, 99)} | {"max": round(max(vals), 3), "n": len(vals)}

    parted = [r for r in rows if r["parted_at"] is not None]
    return {"prompts": len(rows), "first_token": dist("first"), f"within_{DECODE}_tokens": dist("max"),
            "texts_parted": len(parted),
            "parted_gaps": sorted(round(r["gap"], 3) for r in parted if r["gap"] is not None),
            "parted_at_step": sorted(r["parted_at"] for r in parted)}


def statement(result: dict[str, Any]) -> str:
    """The sentence of docs/api.md ("Reproducibility"), made from a result (tests/test_docs.py checks
    the page says it)."""
    s = result["summary"]
    first, within, gaps = s["first_token"], s[f"within_{DECODE}_tokens"], s["parted_gaps"]
    lengths = ", ".join(str(n) for n in result["prefix_tokens"][:-1]) + f" and {result['prefix_tokens'][-1]}"
    parted = (f", where the fresh run's two likeliest tokens were {gaps[0]:.2f}–{gaps[-1]:.2f} apart "
              f"(median {gaps[len(gaps) // 2]:.2f})") if gaps else ""
    return (f"over {s['prompts']} prompts (prefixes of {lengths} tokens) the first token's logprob differs by "
            f"{first['p50']:.2f} at the median, {first['p95']:.2f} at p95 and at most {first['max']:.2f}; within "
            f"{DECODE} tokens by {within['p50']:.2f} at the median, {within['p95']:.2f} at p95 and at most "
            f"{within['max']:.2f}; {s['texts_parted']} of {s['prompts']} greedy texts parted{parted}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200, help="how many prompts, spread over the lengths")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[32, 128, 480, 800])
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: the least CPU on a loaded machine)")
    ap.add_argument("--record", type=Path, help="also write the JSON to this file")
    args = ap.parse_args()
    from edge.config import ModelConfig
    from edge.model.gguf import read_gguf_info
    from edge.model.llm import load_gguf_model

    path = gemma_path()
    cfg = ModelConfig(name="gemma3-270m", path=str(path), n_ctx=2048, n_threads=args.threads, use_mlock=False)
    m = load_gguf_model(cfg, read_gguf_info(path))
    load_before, t0, rows = os.getloadavg(), time.monotonic(), []
    try:
        for i in range(args.prompts):
            kind, prefix = ("words", "sentences")[i % 2], args.prefix_tokens[(i // 2) % len(args.prefix_tokens)]
            rows.append(measure(m, kind, 1000 + i, prefix))
            if (i + 1) % 20 == 0:
                print(f"bench cache_bound: {i + 1}/{args.prompts}", file=sys.stderr)
    finally:
        m.close()
    result = {"model": "builtin:gemma3-270m (Gemma 3 270M Q4_K_M)", "n_ctx": 2048, "n_batch": cfg.n_batch,
              "threads": args.threads, "question_tokens": QUESTION_TOKENS, "decode_tokens": DECODE,
              "prefix_tokens": args.prefix_tokens, "summary": summary(rows),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]},
              "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    emit(result, "cache-bound")
    if args.record:
        args.record.write_text(json.dumps(result, indent=1) + "\n")
    print(statement(result), file=sys.stderr)


if __name__ == "__main__":
    main()
