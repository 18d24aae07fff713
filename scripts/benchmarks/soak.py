"""The soak of issue 57: N clients (10, half of them streamed) ask one generation after another
(16 to 300 tokens) of `edge serve` under the PID-1 stand-in (Gemma 3 270M by default), while the
service is reloaded in place and handed over to a new process (`edge reload --process`) in turn,
one every `--every` seconds, for `--minutes`. It counts what the clients see: every status, the
5xx, the streams cut (a response not whole, or no `[DONE]`), the streams the server ended (their
error event at a drain's limit), connection errors; per handover what the old process passed on,
what its limit ended, and how long after the switch it was gone. JSON to stdout (and .bench/soak.json).

    scripts/bench soak [--minutes 15] [--clients 10] [--every 45] [--drain-timeout 30] [--model gemma|tiny]

A short version is a test: tests/lifecycle/test_drain_limit.py (4 reloads, tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import EDGE, WORDS, edge_config, emit, env_for_bench, gemma_path
from harness import PidOne
from harness.answers import Answer, Loop

from edge.serve.bench import percentile

TINY_NO_EOS = {"2": -100}  # the tiny model's end of sequence: its generations run to max_tokens


def body_for(seed: int, tiny: bool):
    """The n-th request of client i: a prompt of a few words, 16 to 300 tokens; odd clients stream."""
    def make(i: int, n: int) -> dict[str, Any]:
        rng = random.Random(seed * 1_000_003 + i * 10_007 + n)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        b = {"prompt": f"Write about {words}.", "max_tokens": rng.randint(16, 300), "temperature": 0.7,
             "seed": rng.randint(0, 2**31), "stream": i % 2 == 1}
        if tiny:
            b["logit_bias"] = TINY_NO_EOS
        return b
    return make


def reload(cfg: Path, process: bool) -> tuple[bool, str]:
    r = subprocess.run([*EDGE, "reload", "--config", str(cfg), "--process" if process else "--in-place"],
                       capture_output=True, text=True, timeout=900, env=env_for_bench())
    return r.returncode == 0, (r.stderr or r.stdout)[-400:]


def handover(pid1: PidOne, cfg: Path, state: Path) -> dict[str, Any]:
    """One `edge reload --process`: its report's counts, and the old process's exit after the switch."""
    old = pid1.proc
    ok, said = reload(cfg, True)
    if not ok:
        return {"ok": False, "error": said}
    report = json.loads((state / "last-reload.json").read_text())
    new = report["successor"]["pid"]
    switch = pid1.wait_for("MAINPID", str(new), pid=old.pid, timeout=120)
    old.wait(180)
    report = json.loads((state / "last-reload.json").read_text())  # rewritten after the drain
    return {"ok": True, "gone_after_switch_s": round(old.exited_at - switch.at, 3), "passed_on": report.get("passed_on"),
            "ended_at_limit": report.get("ended_at_limit"), "drain_s": report.get("drain_s")}


def tally(answers: list[Answer]) -> dict[str, Any]:
    streams = [a for a in answers if a.streamed]
    cut = [a for a in streams if a.status == 200 and not a.done]
    ended = [a for a in streams if a.done and a.error_event is not None]
    lat = [a.ended - a.started for a in answers if a.status == 200]
    return {"requests": len(answers), "streams": len(streams), "by_status": dict(Counter(a.status for a in answers)),
            "5xx": sum(1 for a in answers if a.status >= 500), "connection_errors": sum(1 for a in answers if a.status == 0),
            "cut_streams": len(cut), "streams_ended_by_server": len(ended),
            "p50_s": round(percentile(lat, 0.5), 3), "p99_s": round(percentile(lat, 0.99), 3),
            "samples": [(a.statuses, a.error, a.body[-160:].decode("utf-8", "replace")) for a in
                        [x for x in answers if x.status != 200] + cut][:5]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="edge-soak-"))
    tiny = args.model == "tiny"
    if tiny:
        from harness.ggufgen import write_tiny_llama

        model = write_tiny_llama(folder / "tiny.gguf")
    else:
        model = gemma_path()
    cfg = edge_config(folder, model, args.n_ctx)
    cfg.write_text(cfg.read_text() + f"[server]\ndrain_timeout_s = {args.drain_timeout}\n")
    events: list[dict[str, Any]] = []
    log = folder / "service.log"  # kept: the drains' lines, what each process logged
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env_for_bench(), log_path=log) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        loop = Loop(pid1.address, args.clients, body_for(args.seed, tiny), timeout=600).start()
        end = time.monotonic() + 60 * args.minutes
        process = False
        while time.monotonic() + args.every < end:
            time.sleep(args.every)  # a benchmark's pacing: the reloads come at a steady rhythm under load
            t0 = time.monotonic()
            if process:
                e = {"kind": "handover", **handover(pid1, cfg, folder / "state")}
            else:
                ok, said = reload(cfg, False)
                e = {"kind": "in-place", "ok": ok, **({} if ok else {"error": said})}
            e["s"] = round(time.monotonic() - t0, 2)
            events.append(e)
            print(json.dumps(e), flush=True)
            process = not process
        answers = loop.stop(900)
        pid1.stop()
    handovers = [e for e in events if e["kind"] == "handover" and e.get("ok")]
    return {"model": "tiny" if tiny else "gemma3-270m", "minutes": args.minutes, "clients": args.clients,
            "drain_timeout_s": args.drain_timeout, "n_ctx": args.n_ctx, "load_average": os.getloadavg(),
            **tally(answers), "in_place_reloads": sum(1 for e in events if e["kind"] == "in-place" and e["ok"]),
            "handovers": len(handovers), "failed_reloads": [e for e in events if not e.get("ok")],
            "passed_on": sum(e["passed_on"] or 0 for e in handovers),
            "ended_at_limit": sum(e["ended_at_limit"] or 0 for e in handovers),
            "old_gone_after_switch_max_s": max((e["gone_after_switch_s"] for e in handovers), default=None),
            "events": events, "service_log": str(log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--every", type=float, default=45.0, help="seconds between reloads (in place and handover in turn)")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--model", choices=("gemma", "tiny"), default="gemma")
    ap.add_argument("--seed", type=int, default=57)
    emit(run(ap.parse_args()), "soak")


if __name__ == "__main__":
    main()
