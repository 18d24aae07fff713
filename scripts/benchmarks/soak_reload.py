"""A soak of reloads that keep the model (issue 51's "Done when"; `scripts/bench soak_reload`):
`edge serve` with the builtin Gemma 3 270M and edge's defaults (neither n_ctx nor parallel set),
8 clients sending completions without a pause, and `edge reload` every 30 s between two configs
that differ only in `server.max_queue`
(each reload keeps the model and its worker) for 10 minutes. Reports (JSON on stdout, also
.bench/soak-reload.json): requests answered and failed, reloads and whether each kept the model,
the service log's llama_decode errors, latency p50/p95/longest. Exits 1 when a request failed, a
reload failed or reloaded the model, or a decode error was logged: the target is 0 of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import emit, env_for_bench, gemma_path
from harness import EDGE, PidOne
from harness.soak import every, reload_soak


def config(folder: Path, model: Path, max_queue: int, threads: int) -> Path:
    """edge's defaults but for the model, its threads and the queue bound; one state dir for both."""
    cfg = folder / f"edge-{max_queue}.toml"
    cfg.write_text(f'[server]\nmax_queue = {max_queue}\n[paths]\nstate_dir = "{folder / "state"}"\n'
                   f'cache_dir = "{folder / "cache"}"\n[[models]]\nname = "gemma"\npath = "{model}"\n'
                   f'n_threads = {threads}\n')
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--reload-every", type=float, default=30.0, help="seconds between reloads")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edge-soak-reload-"))
    model = gemma_path()
    configs = (config(folder, model, 64, args.threads), config(folder, model, 65, args.threads))
    load_before = os.getloadavg()
    request = {"prompt": "Write a short note about the weather in three sentences.", "max_tokens": args.max_tokens,
               "temperature": 0.8}
    with PidOne([*EDGE, "serve", "--config", str(configs[0])], env=env_for_bench()) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=600)
        rounds = int(args.minutes * 60 // args.reload_every)
        got = reload_soak(pid1.address, configs, pid1.log_path, request, clients=args.clients,
                          pace=every(args.reload_every, rounds))
        rc = pid1.stop()
    result = {"minutes": args.minutes, "reload_every_s": args.reload_every, "clients": args.clients,
              "max_tokens": args.max_tokens, "threads": args.threads, "service_exit": rc, **got.as_dict(),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}, "cpus": os.cpu_count()}
    emit(result, "soak-reload")
    bad = got.failed or result["reloads_failed"] or result["reloads_that_reloaded_the_model"] or got.decode_errors
    sys.exit(1 if bad or rc != 0 else 0)


if __name__ == "__main__":
    main()
