"""LoRA adapters in continuous batching (issue 55): what mixing adapter selections costs and
whether any sequence starves.

One model (the builtin Gemma 3 270M, or `--model`), two random LoRA adapters generated for it
(harness.ggufgen.write_lora_for: rank `--rank` on attn_q and attn_v), `parallel = --sequences`.
In process, through edge's scheduler (edge.model.slots) as a served model runs it: `--sequences`
greedy sequences of `--tokens` tokens each, started together, in three mixes: all on the base
model, all on adapter a, and mixed (base, a, b, a+b at 0.5 in turn). Per mix: tokens/s over all
sequences, and the starvation figures: each sequence's longest wait between two of its tokens
(in scheduler steps and seconds), and the spread of the sequences' finish times (slowest /
fastest). Rounds alternate the mixes' order; medians. Prints JSON (also .bench/adapters.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit, gemma_path
from edge.config import AdapterConfig, ModelConfig
from edge.model.adapters import select
from edge.model.generate import GenParams, Job, Piece
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from harness.ggufgen import write_lora_for

PROMPT = "Write a short note about the weather in the mountains in early spring."


class Timed:
    """A sequence's sink: the step and time of each piece."""

    def __init__(self, slots: Any) -> None:
        self.slots, self.marks, self.done = slots, [], False

    def put(self, piece: Piece) -> None:
        self.marks.append((self.slots.stats.steps, time.perf_counter()))

    def close(self, error: BaseException | None) -> None:
        if error is not None:
            raise SystemExit(f"a sequence failed: {error}")
        self.done = True


def mix(m: GGUFModel, name: str, n: int) -> list[tuple]:
    a = m.adapters
    sels = {"base": [()], "adapter": [select("m", a, "a", None)],
            "mixed": [(), select("m", a, "a", None), select("m", a, "b", None),
                      select("m", a, None, [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5}])]}[name]
    return [sels[i % len(sels)] for i in range(n)]


def run(m: GGUFModel, name: str, n: int, tokens: int, tag: str) -> dict[str, float]:
    """Each sequence its own prompt (no prefix reused across sequences or runs); `remember`
    off, so no run pays for saving an earlier run's states (adapted sequences never save any)."""
    slots = m.slots
    sinks = [Timed(slots) for _ in range(n)]
    jobs = [Job(tokens=m.tokenize_prompt(f"Run {tag}, note {i}. {PROMPT}"), adapters=sel, remember=False,
                params=GenParams(max_tokens=tokens, temperature=0, stop=())) for i, sel in enumerate(mix(m, name, n))]
    t0 = time.perf_counter()
    for j, s in zip(jobs, sinks):
        slots.start(j, s)
    while slots.step():
        pass
    wall = time.perf_counter() - t0
    gaps = [max((b[0] - a[0] for a, b in zip(s.marks, s.marks[1:])), default=0) for s in sinks]
    gap_s = [max((b[1] - a[1] for a, b in zip(s.marks, s.marks[1:])), default=0.0) for s in sinks]
    ends = [s.marks[-1][1] - t0 for s in sinks]
    made = sum(j.completion_tokens for j in jobs)
    return {"tokens_per_s": made / wall, "max_gap_steps": max(gaps), "max_gap_s": max(gap_s),
            "finish_spread": max(ends) / min(ends)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF model (default: the builtin Gemma 3 270M)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    load_before = os.getloadavg()
    model = args.model or gemma_path()
    with tempfile.TemporaryDirectory(prefix="edge-bench-adapters-") as d:
        loras = [write_lora_for(model, Path(d) / f"{k}.gguf", seed=i, rank=args.rank) for i, k in enumerate("ab")]
        cfg = ModelConfig(name="m", path=str(model), n_ctx=4096, n_threads=args.threads, use_mlock=False,
                          parallel=args.sequences, adapters=[AdapterConfig(k, str(p)) for k, p in zip("ab", loras)])
        m = load_gguf_model(cfg, read_gguf_info(model))
        try:
            names = ["base", "adapter", "mixed"]
            got: dict[str, list[dict[str, float]]] = {k: [] for k in names}
            run(m, "mixed", args.sequences, 4, "first")  # first-use costs out of the rounds
            for r in range(args.rounds):
                for k in names if r % 2 == 0 else names[::-1]:
                    got[k].append(run(m, k, args.sequences, args.tokens, f"{r}-{k}"))
        finally:
            m.close()
    result = {"model": str(model.name), "sequences": args.sequences, "tokens": args.tokens, "rank": args.rank,
              "rounds": args.rounds, "threads": args.threads, "cpus": os.cpu_count(),
              "mixes": {k: {f: round(statistics.median(x[f] for x in v), 4) for f in v[0]} for k, v in got.items()},
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}}
    emit(result, "adapters")
    for k, v in result["mixes"].items():
        print(f"{k:>8}: {v['tokens_per_s']:.1f} tok/s, longest wait {v['max_gap_steps']} steps "
              f"({v['max_gap_s'] * 1000:.0f} ms), finish spread {v['finish_spread']:.2f}x", file=sys.stderr)


if __name__ == "__main__":
    main()
