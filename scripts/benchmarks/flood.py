"""A normal client's wait under an idle-connection flood (issue 23): JSON.

Per scenario (edge's default limits; LimitNOFILE=1024, where edge lowers max_connections to
768) and round: a fresh `edge serve` of the tests' tiny model, socket-activated by the test kit's
PidOne; `--connections` connections that each send half a request head and hold it; then one
normal completion request on a new connection, timed from connect to the whole answer. The
header timeout is edge's default unless `--header-timeout` says otherwise: without shedding, the
normal client waits for it.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from benchmarks.common import EDGE, ROOT, emit, env_for_bench, summary
from edge.config import ServerConfig
from edge.serve.client import request
from harness.ggufgen import write_tiny_llama
from harness import PidOne, half_heads, metric

NORMAL = b'{"prompt": "Hello", "max_tokens": 2, "temperature": 0}'
SCENARIOS = {"default-limits": None, "LimitNOFILE=1024": 1024}


def _config(folder: Path, model: Path, header_timeout_s: float) -> Path:
    cfg = folder / "edge.toml"
    cfg.write_text(f'[server]\nheader_timeout_s = {header_timeout_s}\n'
                   f'[paths]\nstate_dir = "{folder / "state"}"\ncache_dir = "{folder / "cache"}"\n'
                   f'[[models]]\nname = "tiny"\npath = "{model}"\nn_ctx = 256\n'
                   f'[warmup]\nenabled = false\n')
    return cfg


def one_round(cfg: Path, nofile: int | None, connections: int, timeout_s: float) -> dict[str, Any]:
    argv = [*EDGE, "serve", "--config", str(cfg)]
    if nofile is not None:
        argv = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *argv]
    with PidOne(argv, env=env_for_bench(), backlog=4096) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        flood = half_heads(pid1.address, connections)
        try:
            t0 = time.monotonic()
            try:
                status, _ = request(pid1.address, "POST", "/v1/completions", NORMAL, timeout=timeout_s)
            except OSError as exc:
                status = f"{type(exc).__name__}: {exc}"
            waited = time.monotonic() - t0
            try:
                shed = metric(pid1.address, "edge_connections_shed_total")
            except KeyError:
                shed = None  # an edge without shedding
        finally:
            for c in flood:
                c.close()
        pid1.stop()
    return {"status": status, "normal_client_s": round(waited, 4), "shed": shed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1100, help="flood connections, each half a head")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--header-timeout", type=float, default=ServerConfig().header_timeout_s,
                    help="server.header_timeout_s (default: edge's)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    load_before = os.getloadavg()
    result: dict[str, Any] = {"connections": args.connections, "header_timeout_s": args.header_timeout,
                              "rounds": args.rounds, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="edge-bench-flood-") as tmp:
        folder = Path(tmp)
        model = write_tiny_llama(folder / "tiny.gguf")
        cfg = _config(folder, model, args.header_timeout)
        for name, nofile in SCENARIOS.items():
            rounds = [one_round(cfg, nofile, args.connections, args.header_timeout + 10)
                      for _ in range(args.rounds)]
            waits = [r["normal_client_s"] for r in rounds]
            result["scenarios"][name] = {"rounds": rounds, "normal_client_s": summary(waits),
                                         "ratio_to_header_timeout": round(max(waits) / args.header_timeout, 3)}
    result["load_average"] = {"before": [round(x, 2) for x in load_before],
                              "after": [round(x, 2) for x in os.getloadavg()]}
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result["git"] = rev.stdout.strip()
    emit(result, "flood")


if __name__ == "__main__":
    main()
