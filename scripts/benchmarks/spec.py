"""Speculative decoding (issue 54): edge with proposals from the context against llama.cpp's own
`llama-server` built from the same llama.cpp (scripts/build-llama-server), same GGUF (the builtin
Gemma 3 270M), same threads, context and slots; and edge with speculation off as the baseline for
novel prose. Four servers, up together, taking turns request by request (the order alternating
every round):

- `edge` (edge's default `[models.speculative]`), `edge_off` (`mode = "off"`);
- `llama-server` without speculation, and `llama-server_ngram` with `--spec-type ngram-simple`
  (its n-gram lookup from the context; the flags the built binary accepts are checked with --help,
  and the argv is in the result).

Workloads, chat requests (each server applies the GGUF's template), greedy, prompts made from a
seed and never seen by a warm-up:
- `copy`: >= 20 answers that copy spans of the prompt -- a list reformatted, fields extracted into
  JSON, a code block edited (a function renamed) -- tokens/s;
- `schema`: a json_schema response with long property names (response_format; llama-server turns
  the schema into its grammar itself), ms/token;
- `prose`: novel text to continue (little to copy): tokens/s, edge against edge_off.
With 1 client and with `--clients` (8) at once. Prints JSON (also .bench/spec.json) with each
server's numbers, the ratios edge / peer, the targets of issue 54 and the load average; reports,
never asserts. On a shared machine read the ratios, and rerun quietly for the numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import (WORDS, Peer, Started, edge_config, emit, env_for_bench, gemma_path, http,
                               llama_server, novel_prompts, start_edge, start_peer)
from benchmarks.concurrency import split
from benchmarks.steady import CHAT_TEMPLATE

SERVERS = ("edge", "edge_off", "llama-server", "llama-server_ngram")
TARGETS = {"copy_tokens_per_s_over_llama-server": 1.5, "copy_tokens_per_s_over_llama-server_ngram": 1.0,
           "schema_ms_per_token_over_llama-server": 0.35, "prose_tokens_per_s_over_edge_off": 1 / 1.02}
LONG_KEYS = ("customer_full_legal_name", "primary_shipping_address_line", "preferred_contact_telephone_number",
             "account_creation_calendar_date")
SCHEMA = {"type": "object", "properties": {k: {"type": "string"} for k in LONG_KEYS}, "required": list(LONG_KEYS)}


def copy_prompts(n: int, seed: int) -> list[str]:
    """n copy-heavy requests, a third of each kind, from seeded words (none of the warm-up's texts)."""
    rng = random.Random(seed)
    kinds = (_reformat, _extract, _code_edit)
    return [kinds[i % 3](rng) for i in range(n)]


def _reformat(rng: random.Random) -> str:
    items = rng.sample(WORDS, 12)
    return ("Here is a list: " + ", ".join(items) + ".\nRewrite it as a bulleted list, one item per line, "
            "in the same order, nothing else.")


def _extract(rng: random.Random) -> str:
    people = [(f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}", rng.randint(18, 90),
               f"{rng.choice(WORDS)} {rng.choice(WORDS)} street") for _ in range(4)]
    text = " ".join(f"{n} is {a} years old and lives at {s}." for n, a, s in people)
    return text + "\nList every person as a JSON array of objects with the keys name, age and address."


def _code_edit(rng: random.Random) -> str:
    a, b, c = rng.sample(WORDS, 3)
    code = (f"def {a}_total({b}, {c}):\n    result = 0\n    for item in {b}:\n        if item > {c}:\n"
            f"            result += item\n    return result\n\n\nprint({a}_total([1, 2, 3], 1))\n")
    return f"```python\n{code}```\nRename the function {a}_total to compute_{a} everywhere. Give the whole code."


Ask = tuple[str, bool]  # a user message, and whether it is answered under SCHEMA


def request(server: str, ask: Ask, max_tokens: int, gbnf: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of one greedy request as `server` takes it: edge a chat request (its config
    sets the template), llama-server the text that template renders, under the same grammar."""
    prompt, schema = ask
    common = {"max_tokens": max_tokens, "temperature": 0}
    if server.startswith("edge"):
        body: dict[str, Any] = {**common, "messages": [{"role": "user", "content": prompt}]}
        if schema:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "customer", "schema": SCHEMA}}
        return "/v1/chat/completions", body
    return "/v1/completions", {**common, "prompt": rendered(prompt), **({"grammar": gbnf} if schema else {})}


def rendered(prompt: str) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    text = Jinja2ChatFormatter(template=CHAT_TEMPLATE, eos_token="<eos>", bos_token="<bos>")(
        messages=[{"role": "user", "content": prompt}]).prompt
    return text.removeprefix("<bos>")  # llama-server adds its BOS


def timed(address: tuple[str, int], path: str, body: dict[str, Any]) -> tuple[float, int]:
    t0 = time.perf_counter()
    status, payload = http(address, "POST", path, body, timeout=600)
    took = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {address}: {payload[:300]!r}")
    return took, int(json.loads(payload)["usage"]["completion_tokens"])


def burst(s: Started, name: str, asks: list[Ask], clients: int, max_tokens: int, gbnf: str) -> tuple[float, int]:
    """Every request sent, `clients` at a time: (wall seconds, completion tokens)."""
    reqs = [request(name, a, max_tokens, gbnf) for a in asks]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda r: timed(s.address, *r), reqs))
    return time.perf_counter() - t0, sum(n for _, n in done)


def peers(binary: Path, model: Path, n_ctx: int, threads: int, slots: int) -> dict[str, Peer]:
    """llama-server as it is, and with its n-gram speculation (where the binary has --spec-type)."""
    import subprocess

    base = llama_server(binary, model, n_ctx, threads, parallel=slots)
    helptext = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--spec-type" not in helptext or "ngram-simple" not in helptext:
        raise SystemExit(f"{binary} has no --spec-type ngram-simple (an older llama.cpp): nothing to compare with")
    return {"llama-server": base,
            "llama-server_ngram": Peer("llama-server", lambda port: [*base.argv(port), "--spec-type", "ngram-simple"],
                                       "/health")}


def workloads(args: argparse.Namespace, model: Path, rounds: int) -> dict[str, list[list[Ask]]]:
    """Per workload, per round, the bodies (each round's prompts new)."""
    n = args.prompts
    prose = novel_prompts(model, args.prose_tokens, list(range(1, 1 + rounds * n)))
    return {"copy": [[(p, False) for p in copy_prompts(n, 1000 + r)] for r in range(rounds)],
            "schema": [[(f"Make up a customer record number {r * n + i}.", True) for i in range(n)]
                       for r in range(rounds)],
            "prose": [[("Continue this text: " + p, False) for p in prose[r * n:(r + 1) * n]] for r in range(rounds)]}


def run(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    from edge.serve.schema import schema_grammar

    slots = max(args.clients, 1)
    common = f"parallel = {slots}\nchat_template = {json.dumps(CHAT_TEMPLATE)}\n"
    cfg_on = edge_config(tmp / "edge", model, args.n_ctx, n_threads=args.threads, extra_model=common)
    cfg_off = edge_config(tmp / "edge_off", model, args.n_ctx, n_threads=args.threads,
                          extra_model=common + '[models.speculative]\nmode = "off"\n')
    gbnf = schema_grammar(SCHEMA, "response_format.json_schema")
    ps = peers(args.llama_server, model, args.n_ctx, args.threads, slots)
    rounds = args.rounds
    work = workloads(args, model, 2 * rounds)  # 1 client, then many: new prompts for each
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        servers = {"edge": stack.enter_context(start_edge(cfg_on, env_for_bench())),
                   "edge_off": stack.enter_context(start_edge(cfg_off, env_for_bench()))}
        for name, peer in ps.items():
            servers[name] = stack.enter_context(start_peer(peer, tmp / f"{name}.log"))
        for s in servers.values():
            s.ready_at()
        since = {k: split(servers[k].address) for k in ("edge", "edge_off")}
        for c_i, clients in enumerate((1, args.clients)):
            for wl, per_round in work.items():
                got: dict[str, list[tuple[float, int]]] = {k: [] for k in servers}
                for r in range(rounds):
                    order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        got[name].append(burst(servers[name], name, per_round[c_i * rounds + r], clients,
                                                 args.max_tokens, gbnf))
                results[f"{wl}_{clients}"] = {k: _rate(v) for k, v in got.items()}
                results[f"{wl}_{clients}"]["load1"] = round(os.getloadavg()[0], 2)
                print(f"{wl} x{clients}: {results[f'{wl}_{clients}']}", file=sys.stderr)
        # where edge's steps spent their time (llama_decode, sampling, the rest), and what its proposals did
        results["edge_steps"] = {k: split(servers[k].address, since[k]) for k in since}
        results["edge_speculative"] = speculative(servers["edge"].address)
    results["argv"] = {k: p.argv("PORT") for k, p in ps.items()}
    return results


def speculative(address: tuple[str, int]) -> dict[str, float]:
    from harness import metric

    got = {k: metric(address, f"edge_speculative_{k}_total", model="gemma")
           for k in ("drafted_tokens", "accepted_tokens", "verify_steps", "paused")}
    got["acceptance"] = round(got["accepted_tokens"] / got["drafted_tokens"], 3) if got["drafted_tokens"] else 0.0
    return got


def _rate(rounds: list[tuple[float, int]]) -> dict[str, float]:
    tps = [n / w for w, n in rounds if w > 0]
    return {"tokens_per_s": round(statistics.median(tps), 2), "ms_per_token": round(1000 / statistics.median(tps), 2),
            "tokens": sum(n for _, n in rounds)}


def ratios(results: dict[str, Any], clients: int) -> dict[str, Any]:
    out = {}
    for wl, base in (("copy", "llama-server"), ("copy", "llama-server_ngram"), ("schema", "llama-server"),
                     ("prose", "edge_off"), ("prose", "llama-server")):
        r = results.get(f"{wl}_{clients}")
        if r:
            key = "ms_per_token" if wl == "schema" else "tokens_per_s"
            out[f"{wl}_{key}_over_{base}"] = round(r["edge"][key] / r[base][key], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="per workload and client count")
    ap.add_argument("--prompts", type=int, default=21, help="requests per round and workload (copy: >= 20)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prose-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, required=True, help="llama-server binary (scripts/build-llama-server)")
    args = ap.parse_args()
    model = gemma_path()
    tmp = Path(tempfile.mkdtemp(prefix="edge-bench-spec-"))
    before = os.getloadavg()
    results = run(args, model, tmp)
    result = {"model": "gemma3-270m Q4_K_M", "threads": args.threads, "rounds": args.rounds, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "targets": TARGETS,
              "ratios": {f"clients_{c}": ratios(results, c) for c in (1, args.clients)}, "results": results,
              "load_average": {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}}
    emit(result, "spec")


if __name__ == "__main__":
    main()
