"""Where a steady request's time goes inside `edge serve`: a py-spy sampling profile (non-blocking,
so edge runs at full speed) of the real service on Gemma 3 270M while it answers novel requests,
split by what each thread was doing:

- llama.cpp compute: inside llama_decode (the model's arithmetic; its OpenMP helper threads are
  not Python threads and are not sampled, so this is the calling thread's share);
- llama.cpp sampling: inside llama_sampler_sample;
- other native calls: tokenize, token pieces, state copies, vocabulary checks;
- edge on the worker thread: Python frames of edge.model.generate / edge.model.promptcache / edge.model.llm;
- HTTP and the event loop: the main thread's Python (uvicorn, h11, starlette, edge.serve.app, JSON);
- idle: the event loop waiting (epoll) and the worker waiting for work.

Also edge's own time per request (everything that is not llama.cpp's compute or sampling, both
threads, tokenizing included), the figure issue 19 bounds at 5 ms for a 100-token prompt with 16
tokens out; a worker thread waiting for the GIL while the event loop runs is counted where it
waits (so on both threads). Prints JSON (also
.bench/profile.json). Needs py-spy (`.venv/bin/pip install py-spy`) and ptrace (root, or
kernel.yama.ptrace_scope = 0).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


from benchmarks.steady import banned_tokens, body, timed  # requests as `scripts/bench steady` sends them
from benchmarks.common import edge_config, emit, env_for_bench, gemma_path, novel_prompts, start_edge

# The leaf Python frame of a sample says what the thread was doing: a ctypes call shows as the
# Python function that made it (py-spy without --native never pauses edge). Leaves are
# `Class.function (file:line)`. Both edge's own loop (edge/model/native.py, edge/model/generate.py) and
# llama-cpp-python's (llama_cpp/, as edge used before) are recognised, so that the same profile
# reads any version.
NATIVE = {"decode": "llama.cpp compute", "decode_one": "llama.cpp compute", "sample": "llama.cpp sampling"}
NATIVE_FILES = ("edge/model/native.py", "edge/model/generate.py", "llama_cpp/_internals.py", "llama_cpp/llama_cpp.py")
WAITING = {"select", "_worker", "wait", "get", "acquire", "_wait_for_tstate_lock"}


def classify(stack: str) -> str:
    """One folded stack (`thread (id): name;frame;...;leaf`, root first) to its bucket."""
    frames = stack.split(";")
    thread, leaf = frames[0], frames[-1]
    func = leaf.split(" (")[0].split(".")[-1]
    where = leaf.rsplit("(", 1)[-1]
    if func in WAITING:
        return "idle"
    if "edge-" in thread:  # a model's worker thread
        if any(f in where for f in NATIVE_FILES) and func in NATIVE:
            return NATIVE[func]
        if "edge/model/native.py" in where or ("llama_cpp/" in where and func not in NATIVE):
            return "other native calls" if "edge/" in where or "_internals" in where else "llama-cpp-python"
        return "edge on the worker thread"
    if "MainThread" in thread:
        return "HTTP and the event loop"
    return "other threads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    args = ap.parse_args()
    model = gemma_path()
    bias = banned_tokens(model)
    prompts = novel_prompts(model, 100, list(range(1, args.requests + 3)))
    tmp = Path(tempfile.mkdtemp(prefix="edge-profile-"))
    cfg = edge_config(tmp / "edge", model, 2048, n_threads=args.threads)
    folded = tmp / "profile.txt"
    with start_edge(cfg, env_for_bench()) as s:
        s.ready_at()
        for p in prompts[:2]:
            timed(s.address, body(p, 16, bias))  # first requests, not profiled
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--threads",
                                "--idle", "--nonblocking", "--rate", str(args.rate), "--format", "raw",
                                "-o", str(folded), "--pid", str(s.pid)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in spy.stdout:  # py-spy says when it samples
            if b"Sampling process" in line:
                break
        threading.Thread(target=spy.stdout.read, daemon=True).start()  # the rest, never a full pipe
        t0 = time.perf_counter()
        walls = [timed(s.address, body(p, 16, bias))[0] for p in prompts[2:]]
        wall = time.perf_counter() - t0
        spy.send_signal(2)
        spy.wait(60)
    buckets: collections.Counter[str] = collections.Counter()
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            buckets[classify(stack)] += int(count)
    busy = {k: v for k, v in buckets.items() if k != "idle"}
    total = sum(busy.values())
    share = {k: round(v / total, 4) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])}
    per_request_ms = {k: round(1000 * v / args.rate / len(walls), 2) for k, v in busy.items()}
    edge_ms = sum(per_request_ms.get(k, 0.0) for k in ("edge on the worker thread", "HTTP and the event loop",
                                                        "other native calls", "llama-cpp-python"))
    result = {"requests": len(walls), "prompt_tokens": 100, "completion_tokens": 16, "threads": args.threads,
              "rate_hz": args.rate, "request_s_median": round(sorted(walls)[len(walls) // 2], 4),
              "wall_s": round(wall, 3), "samples": dict(buckets), "share_of_busy_samples": share,
              "ms_per_request": per_request_ms, "edge_ms_per_request": round(edge_ms, 2),
              "load_average": [round(x, 2) for x in os.getloadavg()]}
    emit(result, "profile")


if __name__ == "__main__":
    main()
