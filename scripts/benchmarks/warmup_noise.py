"""How noisy is a warm-up candidate's first-minus-repeat on this machine? (JSON)

Loads the model of a config (default: the embedded Gemma) as a start does, then calibrates the
candidates ROUNDS times in the same process with a zero threshold. Round 1 is a real
calibration; in later rounds nothing is lazy any more, so their first - repeat is pure noise:
the spread the keep threshold ([warmup] min_gain_s, min_gain_ratio) must stay above.

    scripts/bench warmup_noise [--config F] [--rounds N] [--budget S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from edge.lifecycle.loader import Loader, read_config
from edge.lifecycle.systemd import Notifier
from edge.timing import StartTimer
from edge.lifecycle.warmup.calibrate import KeepRule, calibrate
from edge.lifecycle.warmup.steps import LoopbackHTTP, model_candidates, model_floor, run_step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget", type=float, default=30.0)
    args = ap.parse_args()
    timer, notifier = StartTimer(), Notifier()
    notifier.enabled = False
    loader = Loader(read_config(args.config, timer), timer, notifier)
    loaded = loader.load()
    cfg = loader.config.warmup

    async def go() -> dict:
        out: dict = {"rounds": []}
        async with LoopbackHTTP(loaded.app) as http:
            for name, w in loaded.state.workers.items():
                await run_step(http, "floor", model_floor(w.model, cfg).path, model_floor(w.model, cfg).body)
                for r in range(args.rounds):
                    steps = await w.call(model_candidates, w.model, cfg)
                    rows, _, _ = await calibrate(http, steps, KeepRule(0.0, 0.0), args.budget, w.call)
                    out["rounds"].append({"model": name, "round": r + 1, "rows": [
                        {k: row.get(k) for k in ("name", "first_s", "repeat_s", "gain_s")} for row in rows]})
        return out

    try:
        out = asyncio.run(go())
    finally:
        loaded.close()
    later = [row for rnd in out["rounds"][1:] for row in rnd["rows"] if row["gain_s"] is not None]
    gains = [abs(row["gain_s"]) for row in later]
    ratios = [abs(row["gain_s"]) / row["repeat_s"] for row in later if row["repeat_s"]]
    if gains:
        q = statistics.quantiles(gains, n=20) if len(gains) >= 2 else gains
        qr = statistics.quantiles(ratios, n=20) if len(ratios) >= 2 else ratios
        out["noise"] = {"n": len(gains), "abs_gain_median_s": round(statistics.median(gains), 4),
                        "abs_gain_p95_s": round(q[-1], 4), "abs_gain_max_s": round(max(gains), 4),
                        "ratio_median": round(statistics.median(ratios), 3),
                        "ratio_p95": round(qr[-1], 3), "ratio_max": round(max(ratios), 3)}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
