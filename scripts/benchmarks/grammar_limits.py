"""What a grammar costs llama.cpp on this machine, behind edge's grammar bounds (docs/api.md "Grammar
bounds"): JSON on stdout (also .bench/grammar-limits.json), a table on stderr.

- stack: how deep llama.cpp's grammar parser (nested groups) and its left-recursion check (a chain
  of rule references) go before they overflow a thread stack of each size: each try compiles in
  a child process (an overflow is a SIGSEGV), by bisection.
- cost: compile time and the time to sample one token under an `enum` of N strings, as
  llama-cpp-python's converter writes it (N alternatives) and as edge does (a trie), on Gemma 3
  270M's 262k vocabulary, each the median of --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def grammar(shape: str, n: int) -> str:
    if shape == "nest":
        return "root ::= " + '("a" ' * n + ")" * n
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "a"\n' for i in range(n)) + f'r{n} ::= "c"\n'


def probe(shape: str, n: int, stack: int, model: str) -> None:
    import llama_cpp as L

    L.llama_backend_init()
    m = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(m)
    text = grammar(shape, n).encode()
    threading.stack_size(stack)
    t = threading.Thread(target=lambda: L.llama_sampler_init_grammar(vocab, text, b"root"))
    t.start()
    t.join()


def survives(shape: str, n: int, stack: int, model: Path) -> bool:
    r = subprocess.run([sys.executable, "-m", "benchmarks.grammar_limits", "--probe", shape, str(n), str(stack), str(model)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def crash_depth(shape: str, stack: int, model: Path) -> dict[str, int]:
    lo, hi = 16, 1 << 20
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if survives(shape, mid, stack, model) else (lo, mid)
    return {"survives": lo, "crashes": hi, "bytes_per_level": round(stack / hi)}


def cost(widths: list[int], runs: int) -> list[dict[str, object]]:
    import llama_cpp as L
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from benchmarks.common import gemma_path

    L.llama_backend_init()
    m = L.llama_model_load_from_file(str(gemma_path()).encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(m)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 128, os.cpu_count() or 1, os.cpu_count() or 1
    ctx = L.llama_init_from_model(m, cp)
    L.llama_decode(ctx, L.llama_batch_get_one((L.llama_token * 1)(L.llama_vocab_bos(vocab)), 1))
    threading.stack_size(64 << 20)
    rows = []
    from edge.serve.schema import measure_gbnf, schema_grammar

    for width, how in [(w, h) for w in widths for h in ("converter", "edge")]:
        schema = {"enum": [f"value-{i:06d}" for i in range(width)]}
        gbnf = json_schema_to_gbnf(json.dumps(schema)) if how == "converter" else schema_grammar(schema, "enum")
        compile_s, sample_s = [], []

        def once() -> None:
            t0 = time.perf_counter()
            s = L.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
            compile_s.append(time.perf_counter() - t0)
            chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            L.llama_sampler_chain_add(chain, s)
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            t0 = time.perf_counter()
            L.llama_sampler_sample(chain, ctx, -1)
            sample_s.append(time.perf_counter() - t0)
            L.llama_sampler_free(chain)

        for _ in range(runs):
            t = threading.Thread(target=once)
            t.start()
            t.join()
        rows.append({"enum": width, "grammar": how, "widest": measure_gbnf(gbnf).widest, "gbnf_bytes": len(gbnf), "compile_s": round(statistics.median(compile_s), 4),
                     "sample_token_s": round(statistics.median(sample_s), 4), "runs": runs})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3, help="runs per cost row (median)")
    ap.add_argument("--widths", default="1,16,64,256,1024,4096", help="alternation widths to time")
    ap.add_argument("--stacks-kib", default="256,1024,8192", help="thread stack sizes to probe")
    args = ap.parse_args()
    if args.probe:
        shape, n, stack, model = args.probe
        probe(shape, int(n), int(stack), model)
        return
    from harness.ggufgen import write_tiny_llama

    tiny = write_tiny_llama(Path(os.environ.get("TMPDIR", "/tmp")) / "grammar-limits-tiny.gguf")
    load_before = os.getloadavg()
    stacks = {f"{kib} KiB": {shape: crash_depth(shape, kib << 10, tiny) for shape in ("nest", "chain")}
              for kib in map(int, args.stacks_kib.split(","))}
    rows = cost([int(w) for w in args.widths.split(",")], args.runs)
    result = {"stack": stacks, "cost": rows, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "cpus": os.cpu_count()}
    for size, shapes in stacks.items():
        print(f"{size:>9}: nested groups crash at {shapes['nest']['crashes']}, "
              f"reference chain at {shapes['chain']['crashes']}", file=sys.stderr)
    for r in rows:
        print(f"enum of {r['enum']:>5} ({r['grammar']:>9}, {r['widest']:>4} wide): {r['gbnf_bytes']:>7} bytes, compile {r['compile_s']:.4f} s, "
              f"one token {r['sample_token_s']:.4f} s", file=sys.stderr)
    from benchmarks.common import emit

    emit(result, "grammar-limits")


if __name__ == "__main__":
    main()
