"""Embeddings throughput: edge's `/v1/embeddings` against llama.cpp's own `llama-server
--embeddings`, same GGUF (the builtin Gemma 3 270M), same llama.cpp, same threads, the same
batch (512 tokens) and pooling (mean), flash attention off in both (edge's embeddings default:
an input's vector does not depend on its batch; `--flash-attn` to compare both with it on).

Both servers run at once and take turns, the order alternating every round. A round of a shape
`K x C` sends `--inputs` novel texts (10 to 60 tokens, none seen before by either server) as
requests of K inputs, C clients at once; a server's score is inputs per second over the round's
wall time, the median over rounds. Shapes: 16 x 4 (a client embedding documents in chunks) and
1 x 8 (queries one at a time: batching across requests is the server's). Both answer in base64
(OpenAI's float32 encoding; `--encoding float` for JSON numbers), so the client's parsing takes
little of the 2 cores it shares with the servers. The texts of the first round are embedded by
both and compared: the minimum cosine is in the result. Target: edge / llama-server >= 1.0 at
every shape. Prints JSON (also .bench/embeddings.json) and a table; reports, never asserts; the
load average is part of the result: on a shared machine read the ratios, not the numbers.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (WORDS, Started, edge_config, emit, env_for_bench, gemma_path, llama_server,
                               start_edge, start_peer, summary)
from edge.serve.client import request as http

TARGET = 1.0


def novel_texts(n: int, seed: int) -> list[str]:
    """n texts of 8 to 50 plain words each, drawn by the seed (a round's texts are its own)."""
    rng = random.Random(seed)
    return [f"{i}-{seed}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 50))) for i in range(n)]


def embed(s: Started, texts: list[str], encoding: str, path: str) -> list[list[float]]:
    status, raw = http(s.address, "POST", path, {"model": "gemma", "input": texts, "encoding_format": encoding},
                       timeout=600)
    if status != 200:
        raise RuntimeError(f"{s.name}: HTTP {status}: {raw[:300]!r}")
    data = sorted(json.loads(raw)["data"], key=lambda d: d["index"])
    if len(data) != len(texts):
        raise RuntimeError(f"{s.name} answered {len(data)} vectors for {len(texts)} inputs")
    return [list(memoryview(base64.b64decode(d["embedding"])).cast("f")) if encoding == "base64" else d["embedding"]
            for d in data]


def burst(s: Started, texts: list[str], per_request: int, clients: int, encoding: str, path: str) -> dict[str, Any]:
    requests = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]

    def client(mine: list[list[str]]) -> int:
        return sum(len(embed(s, r, encoding, path)) for r in mine)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(client, [requests[i::clients] for i in range(clients)]))
    wall = time.perf_counter() - t0
    return {"inputs_per_s": done / wall, "wall_s": wall, "load1": os.getloadavg()[0]}


def cosine_floor(a: list[list[float]], b: list[list[float]]) -> float:
    def cos(x: list[float], y: list[float]) -> float:
        dot = sum(p * q for p, q in zip(x, y))
        return dot / ((sum(p * p for p in x) ** 0.5) * (sum(q * q for q in y) ** 0.5))
    return min(cos(x, y) for x, y in zip(a, b))


def servers(args: argparse.Namespace, model: Path, tmp: Path) -> tuple[Path, Any]:
    fa = "true" if args.flash_attn else "false"
    cfg = edge_config(tmp / "edge", model, 512, n_threads=args.threads,
                      extra_model=f'[models.embeddings]\npooling = "mean"\nn_batch = {args.n_batch}\nflash_attn = {fa}\n')
    # llama-server: n_ctx for its slots (each holds one input of up to n_batch tokens), its default
    # slot count unless --parallel; ubatch = batch = n_batch, as edge's embeddings context
    extra = ["--embeddings", "--pooling", "mean", "--flash-attn", "on" if args.flash_attn else "off"]
    peer = llama_server(args.llama_server, model, args.n_batch * max(args.parallel, 4), args.threads,
                        n_batch=args.n_batch, parallel=args.parallel, extra=extra)
    return cfg, peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inputs", type=int, default=128, help="inputs per round and shape")
    ap.add_argument("--shapes", nargs="*", default=["16x4", "1x8"], help="inputs per request x clients")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--parallel", type=int, default=4, help="llama-server's slots (its default is 4)")
    ap.add_argument("--encoding", choices=("base64", "float"), default="base64")
    ap.add_argument("--flash-attn", action="store_true", help="both servers with flash attention on")
    ap.add_argument("--llama-server", type=Path, required=True, help="llama-server binary (scripts/build-llama-server)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]

    from contextlib import ExitStack

    model = gemma_path()
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-embeddings-"))
    load_before = os.getloadavg()
    cfg, peer = servers(args, model, tmp)
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {f"{k}x{c}": {"edge": [], "llama-server": []} for k, c in shapes}
    paths = {"edge": "/v1/embeddings", "llama-server": "/v1/embeddings"}
    with ExitStack() as stack:
        up = {"edge": stack.enter_context(start_edge(cfg, env_for_bench())),
              "llama-server": stack.enter_context(start_peer(peer, tmp / "llama-server.log"))}
        for s in up.values():
            s.ready_at()
            embed(s, ["warm the path once"], args.encoding, paths[s.name])  # llama-server has no warm-up of its own
        check = novel_texts(32, 0)
        floor = cosine_floor(*(embed(up[n], check, args.encoding, paths[n]) for n in ("edge", "llama-server")))
        seed = 1
        for r in range(args.rounds):
            for k, c in shapes:
                texts = novel_texts(args.inputs, seed)
                seed += 1
                order = ["edge", "llama-server"] if r % 2 == 0 else ["llama-server", "edge"]
                for name in order:
                    rounds[f"{k}x{c}"][name].append(burst(up[name], texts, k, c, args.encoding, paths[name]))
    per_shape = {}
    for shape, by in rounds.items():
        e, p = (statistics.median(x["inputs_per_s"] for x in by[n]) for n in ("edge", "llama-server"))
        per_shape[shape] = {"edge_inputs_per_s": round(e, 2), "llama_server_inputs_per_s": round(p, 2),
                            "ratio": round(e / p, 3),
                            "rounds": {n: summary([x["inputs_per_s"] for x in by[n]]) for n in by}}
    result = {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "n_batch": args.n_batch,
              "llama_server_parallel": args.parallel, "flash_attn": args.flash_attn, "encoding": args.encoding,
              "inputs_per_round": args.inputs, "rounds": args.rounds, "cpus": os.cpu_count(),
              "cosine_min_edge_vs_llama_server": round(floor, 6), "target_ratio": TARGET,
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]},
              "llama_server_argv": peer.argv("PORT"), "shapes": per_shape}
    emit(result, "embeddings")
    table(result)


def table(result: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\n{'shape':>8}{'edge in/s':>12}{'llama-server':>14}{'ratio':>8}", file=err)
    for shape, row in result["shapes"].items():
        print(f"{shape:>8}{row['edge_inputs_per_s']:>12}{row['llama_server_inputs_per_s']:>14}{row['ratio']:>8}",
              file=err)
    print(f"min cosine edge vs llama-server: {result['cosine_min_edge_vs_llama_server']}; load average "
          f"{result['load_average']} ({result['cpus']} CPUs)", file=err)


if __name__ == "__main__":
    main()
