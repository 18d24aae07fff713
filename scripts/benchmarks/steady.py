"""Steady-state requests of edge vs two peers on the same model and the same llama.cpp, in one
run: llama.cpp's own `llama-server` and llama-cpp-python's server (`python -m llama_cpp.server`).

Every server runs all the time; per round, in an order that rotates every round, each one gets
the same novel requests (distinct first word, exact token count, greedy, EOS and end-of-turn
banned through `logit_bias` so that every request generates exactly what it asks for):
- decode: a 32-token prompt with max_tokens 1 and with max_tokens 1 + N; ms/token is the
  difference over N (prefill and per-request costs cancel out);
- stream: the same, streamed (server-sent events): edge's streamed ms/token over non-streamed;
- prefill: a ~300-token prompt, max_tokens 1;
- whole request: a ~100-token prompt, max_tokens 16;
- schema decode: decode under a JSON schema's grammar (SCHEMA: at least 40 objects, so that no
  answer can end within the tokens asked for), 1 and 1 + N tokens: edge through chat with
  `response_format: json_schema`, llama-server through /v1/completions with the same prompt
  rendered by the same template and `grammar` set to the GBNF edge makes of the schema, so both
  sample under the very same grammar (llama_cpp.server is left out of this one).
Then edge alone under 1, 4 and 8 concurrent clients (tokens/s). No prompt was seen by a warm-up
or by an earlier request. Prints JSON (also .bench/steady.json) and a table with the ratios
edge / peer (targets: decode and prefill <= 1.03, whole request <= 1.05, streamed <= 1.05 of
non-streamed); reports, never asserts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any


from benchmarks.common import (Started, edge_config, emit, env_for_bench, gemma_path, llama_cpp_server,
                      llama_server, novel_prompts, start_edge, start_peer, summary)
from edge.serve.client import request as http
from edge.serve.schema import schema_grammar as edge_grammar

TARGETS = {"decode_ms_per_token": 1.03, "prefill_s": 1.03, "request_s": 1.05, "schema_decode_ms_per_token": 1.05}
SCHEMA = {"type": "array", "minItems": 40, "maxItems": 60,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                     "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False}}
# Gemma 3's turn format. llama-server gets the text edge's template renders (llama-cpp-python's
# Jinja2 formatter: the template's last newline is Jinja's to drop), its BOS left to llama-server
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>user\n{{ m['content'] }}<end_of_turn>\n"
                 "{% endfor %}<start_of_turn>model\n")
SCHEMA_ASK = "\nThe people above, as a JSON list:"
SCHEMA_SERVERS = ("edge", "llama-server")


def rendered(prompt: str) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    text = Jinja2ChatFormatter(template=CHAT_TEMPLATE, eos_token="<eos>", bos_token="<bos>")(
        messages=[{"role": "user", "content": prompt + SCHEMA_ASK}]).prompt
    return text.removeprefix("<bos>")


def schema_body(server: str, prompt: str, max_tokens: int, bias: dict[str, float], gbnf: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of one greedy request under SCHEMA's grammar, as `server` takes it."""
    common = {"max_tokens": max_tokens, "temperature": 0, "logit_bias": bias, "cache_prompt": False}
    if server == "edge":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt + SCHEMA_ASK}],
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "people", "schema": SCHEMA}}}
    return "/v1/completions", {**common, "prompt": rendered(prompt), "grammar": gbnf}
STREAM_TARGET = 1.05


def banned_tokens(model: Path) -> dict[str, float]:
    """EOS and end-of-turn, banned: every request generates exactly max_tokens tokens."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        v = vocab._model.vocab
        ids = {llama_cpp.llama_vocab_eos(v), llama_cpp.llama_vocab_eot(v)}
        return {str(t): -100.0 for t in sorted(ids) if t >= 0}
    finally:
        vocab.close()


def timed(address: tuple[str, int], body: dict[str, Any], path: str = "/v1/completions") -> tuple[float, int]:
    """(seconds, completion tokens) of one request on its own connection; streamed bodies are
    read to the end ([DONE])."""
    t0 = time.perf_counter()
    status, payload = http(address, "POST", path, body, timeout=600)
    took = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {address}: {payload[:300]!r}")
    if body.get("stream"):
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"]:
            raise RuntimeError(f"stream from {address} did not end with [DONE]")
        return took, sum(1 for e in events[:-1] if json.loads(e).get("choices"))
    return took, int(json.loads(payload)["usage"]["completion_tokens"])


def body(prompt: str, max_tokens: int, bias: dict[str, float], stream: bool = False) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias,
            "stream": stream}


class Prompts:
    """Novel prompts by length, each used once in the whole run (per server)."""

    def __init__(self, model: Path, rounds: int) -> None:
        seeds = iter(range(1, 10_000))
        need = {32: 6 * (rounds + 1), 300: rounds + 1, 100: rounds + 1, 64: 8 * 3}
        self.by_len = {n: novel_prompts(model, n, [next(seeds) for _ in range(k)]) for n, k in need.items()}

    def take(self, n: int) -> str:
        return self.by_len[n].pop()


def one_round(s: Started, p: dict[int, list[str]], decode_n: int, bias: dict[str, float],
              gbnf: str | None = None) -> dict[str, float]:
    a = s.address
    out = {}
    if gbnf is not None and s.name in SCHEMA_SERVERS:
        path, short = schema_body(s.name, p[32][4], 1, bias, gbnf)
        g1, _ = timed(a, short, path)
        path, long = schema_body(s.name, p[32][5], 1 + decode_n, bias, gbnf)
        gn, n = timed(a, long, path)
        if n != 1 + decode_n:
            raise RuntimeError(f"{s.name} generated {n} tokens under the schema, not {1 + decode_n}")
        out["schema_decode_ms_per_token"] = 1000 * (gn - g1) / decode_n
    t1, _ = timed(a, body(p[32][0], 1, bias))
    tn, n = timed(a, body(p[32][1], 1 + decode_n, bias))
    if n != 1 + decode_n:
        raise RuntimeError(f"{s.name} generated {n} tokens, not {1 + decode_n} (EOS not banned?)")
    out["decode_ms_per_token"] = 1000 * (tn - t1) / decode_n
    s1, _ = timed(a, body(p[32][2], 1, bias, stream=True))
    sn, _ = timed(a, body(p[32][3], 1 + decode_n, bias, stream=True))
    out["stream_decode_ms_per_token"] = 1000 * (sn - s1) / decode_n
    out["prefill_s"] = timed(a, body(p[300][0], 1, bias))[0]
    out["request_s"] = timed(a, body(p[100][0], 16, bias))[0]
    return out


def concurrency(s: Started, prompts: list[str], clients: int, bias: dict[str, float], tokens: int) -> dict[str, float]:
    """`clients` at once, each one request of `tokens` tokens: aggregate tokens/s."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda p: timed(s.address, body(p, tokens, bias)), prompts[:clients]))
    wall = time.perf_counter() - t0
    return {"clients": clients, "tokens_per_s": round(sum(n for _, n in done) / wall, 2),
            "p50_s": round(statistics.median(t for t, _ in done), 3), "wall_s": round(wall, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--llama-server", type=Path, help="llama-server binary (scripts/build-llama-server)")
    ap.add_argument("--llama-server-skipped", default="", help="why there is no llama-server")
    ap.add_argument("--only", nargs="*", help="servers to run (edge, llama-server, llama_cpp.server)")
    ap.add_argument("--no-schema", action="store_true", help="leave out the schema decode case")
    ap.add_argument("--fallback", action="store_true", help="also edge with safe mode's first step "
                    "(use_extra_bufts = false): what the fallback costs, as server edge-no-extra-bufts")
    args = ap.parse_args()

    model = gemma_path()
    bias = banned_tokens(model)
    prompts = Prompts(model, args.rounds)
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-steady-"))
    template = f"chat_template = {json.dumps(CHAT_TEMPLATE)}\n"
    cfg = edge_config(tmp / "edge", model, args.n_ctx, n_threads=args.threads, extra_model=template)
    gbnf = None if args.no_schema else edge_grammar(SCHEMA, "response_format.json_schema")
    launchers = {"edge": lambda: start_edge(cfg, env_for_bench())}
    if args.fallback:
        safe = edge_config(tmp / "edge-safe", model, args.n_ctx, n_threads=args.threads,
                           extra_model="use_extra_bufts = false\n")
        launchers["edge-no-extra-bufts"] = lambda: start_edge(safe, env_for_bench())
    peers = [llama_cpp_server(model, args.n_ctx, args.threads)]
    if args.llama_server:
        peers.append(llama_server(args.llama_server, model, args.n_ctx, args.threads))
    for peer in peers:
        launchers[peer.name] = (lambda peer=peer: start_peer(peer, tmp / f"{peer.name}.log"))
    names = [n for n in launchers if not args.only or n in args.only]
    runs: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    with ExitStack() as stack:
        servers = {n: stack.enter_context(launchers[n]()) for n in names}
        first = {32: [prompts.take(32) for _ in range(6)], 300: [prompts.take(300)], 100: [prompts.take(100)]}
        for s in servers.values():
            s.ready_at()
            one_round(s, first, 8, bias, gbnf)  # each server's own first requests, not measured
        for r in range(args.rounds):
            p = {32: [prompts.take(32) for _ in range(6)], 300: [prompts.take(300)], 100: [prompts.take(100)]}
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                for k, v in one_round(servers[n], p, args.decode_tokens, bias, gbnf).items():
                    runs[n].setdefault(k, []).append(v)
        conc = []
        if "edge" in servers:
            for clients in (1, 4, 8):
                conc.append(concurrency(servers["edge"], [prompts.take(64) for _ in range(clients)],
                                        clients, bias, 32))
    result = report(runs, conc, args, os.getloadavg())
    emit(result, "steady")
    table(result)


def report(runs: dict[str, dict[str, list[float]]], conc: list[dict[str, float]], args: argparse.Namespace,
           load: tuple[float, float, float]) -> dict[str, Any]:
    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in runs.items()}
    ratios: dict[str, dict[str, float]] = {}
    for peer in [n for n in med if n != "edge"]:
        if "edge" in med:
            ratios[peer] = {k: round(med["edge"][k] / med[peer][k], 3) for k in med["edge"] if k in med[peer]}
    edge = med.get("edge", {})
    stream_ratio = round(edge["stream_decode_ms_per_token"] / edge["decode_ms_per_token"], 3) if edge else None
    return {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "n_ctx": args.n_ctx,
            "decode_tokens": args.decode_tokens, "rounds": args.rounds,
            "load_average": [round(x, 2) for x in load], "cpus": os.cpu_count(),
            "llama_server_skipped": args.llama_server_skipped or None,
            "servers": {n: {k: summary(v) for k, v in m.items()} for n, m in runs.items()},
            "ratios_edge_over_peer": ratios, "edge_stream_over_nonstream": stream_ratio,
            "targets": {**TARGETS, "stream_over_nonstream": STREAM_TARGET}, "edge_concurrency": conc}


def table(result: dict[str, Any]) -> None:
    servers = result["servers"]
    keys = ["decode_ms_per_token", "stream_decode_ms_per_token", "prefill_s", "request_s", "schema_decode_ms_per_token"]
    err = sys.stderr
    print(f"\n{'median':28}" + "".join(f"{n:>18}" for n in servers), file=err)
    for k in keys:
        print(f"{k:28}" + "".join(f"{servers[n][k]['median']:>18.4f}" if k in servers[n] else f"{'-':>18}"
                                  for n in servers), file=err)
    for peer, r in result["ratios_edge_over_peer"].items():
        print(f"edge / {peer}: " + ", ".join(f"{k} {v}" for k, v in r.items()), file=err)
    print(f"edge streamed / non-streamed decode: {result['edge_stream_over_nonstream']}", file=err)
    for c in result["edge_concurrency"]:
        print(f"edge, {c['clients']} clients: {c['tokens_per_s']} tokens/s (p50 {c['p50_s']} s)", file=err)
    print(f"load average {result['load_average']}", file=err)


if __name__ == "__main__":
    main()
