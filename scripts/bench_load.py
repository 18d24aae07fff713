"""16 concurrent clients against edge on loopback for a bounded time, then the same while the
service is restarted once on its socket. JSON to stdout (and .bench/load.json)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test kit (tests/kit)

from benchlib import EDGE, REQUEST, edge_config, emit, env_for_bench, gemma_path  # noqa: E402
from kit import ClientLoad, LoadResult, PidOne  # noqa: E402


def correct(status: int, body: bytes) -> bool:
    return status == 200 and "Paris" in json.loads(body)["choices"][0]["text"]


def stats(r: LoadResult, seconds: float) -> dict[str, Any]:
    return {"requests": r.ok, "errors": r.errors, "refused": r.refused,
            "requests_per_s": round(r.ok / seconds, 2),
            "p50_s": round(r.percentile(0.50), 4), "p95_s": round(r.percentile(0.95), 4),
            "p99_s": round(r.percentile(0.99), 4), "max_s": round(r.longest_s, 4),
            "error_samples": r.error_samples[:3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    cfg = edge_config(Path(tempfile.mkdtemp(prefix="edge-load-")) / "edge", gemma_path(), 2048)
    body = json.dumps(REQUEST).encode()
    result: dict[str, Any] = {"clients": args.clients, "seconds": args.seconds, "request": REQUEST}
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env_for_bench()) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        for phase in ("steady", "with_restart"):
            print(f"{phase}: {args.clients} clients for {args.seconds:.0f} s", file=sys.stderr)
            load = ClientLoad(pid1.address, body, clients=args.clients, max_seconds=args.seconds + 60,
                              check=correct).start()
            t0 = time.monotonic()
            if phase == "with_restart":
                time.sleep(args.seconds / 3)
                old = pid1.proc.pid
                t_stop = time.monotonic()
                code = pid1.stop()
                pid1.start()
                ready = pid1.wait_for("READY", "1", timeout=300)
                result["restart"] = {"old_pid": old, "new_pid": pid1.proc.pid, "old_exit": code,
                                     "stop_to_ready_s": round(ready.at - t_stop, 3)}
            time.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
            r = load.stop()
            result[phase] = stats(r, time.monotonic() - t0)
        pid1.stop()
    result["targets_met"] = {"0 errors under load": result["steady"]["errors"] + result["steady"]["refused"] == 0,
                             "0 errors across restart": result["with_restart"]["errors"]
                             + result["with_restart"]["refused"] == 0}
    emit(result, "load")
    for phase in ("steady", "with_restart"):
        s = result[phase]
        print(f"{phase:13} {s['requests_per_s']:7.2f} req/s  p50 {s['p50_s']:.3f}  p95 {s['p95_s']:.3f}  "
              f"p99 {s['p99_s']:.3f} s  errors {s['errors']}  refused {s['refused']}", file=sys.stderr)
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
