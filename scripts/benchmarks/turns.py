"""Prefixes that take turns, and chats re-sent with a growing history: edge vs llama.cpp's
`llama-server` with its default cache flags (context checkpoints, RAM prompt cache), the same
model, llama.cpp, threads, n_ctx and batch, in one run (`scripts/bench prefix`, cases `rotation`
and `chat`).

Cases, each on a freshly started server, in an order of servers that alternates every round:
- rotation-2, rotation-3: 2 (3) undeclared prefixes of exactly `--rotation-tokens` tokens, novel
  for every case and round, each followed by a novel 24-token question, sent in strict turns
  (A B A B ..., A B C A B C ...), 4 requests per prefix, `max_tokens = 1`, greedy: the time to the
  answer is the time to first token (TTFT). A repeat is every request after its prefix's first.
- chat: one conversation of 6 turns re-sent with its growing history (a ~300-token system
  message, ~60-token user turns, the server's own streamed answers of at most 32 tokens);
- chats-in-turns: two such conversations whose turns alternate (A1 B1 A2 B2 ...).
  Chat TTFT is the time to the first streamed content; the template is edge's built-in Gemma
  template for both servers (llama-server: --chat-template-file).
Reported per request: TTFT, prompt tokens, cached tokens (usage.prompt_tokens_details); per
case: repeats reusing >= 90 % of their prompt, their TTFT median, the edge / llama-server ratio;
for chats, TTFT per turn and the last turn's over the second's beside the prompt's growth; edge's
prompt cache bytes (/metrics) at the end of each case against its limit. Targets (issue 30) are
reported, never asserted: every rotation repeat reuses >= 90 % and its TTFT median <= 0.25x
llama-server's; a chat turn's TTFT grows with the new turn, not the history (last / second turn
<= 1.5 while the prompt more than doubles); edge's cache within prompt_cache_mb.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from benchmarks.common import Started, novel_prompts, summary

ROTATIONS = {"rotation-2": 2, "rotation-3": 3}
CHATS = {"chat": 1, "chats-in-turns": 2}
CASES = {"rotation": list(ROTATIONS), "chat": list(CHATS)}  # scripts/bench prefix --cases
PER_PREFIX = 4  # requests per prefix in a rotation
TURNS = 6
ANSWER_TOKENS = 32

Launch = Callable[[], AbstractContextManager[Started]]


def _post(address: tuple[str, int], path: str, body: dict[str, Any]) -> Iterator[tuple[float, bytes]]:
    """The response's lines as they arrive, each with the perf_counter() it arrived at."""
    conn = http.client.HTTPConnection(*address, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {address}{path}: {resp.read()[:300]!r}")
        while line := resp.readline():
            yield time.perf_counter(), line
    finally:
        conn.close()


def _cached(usage: dict[str, Any], timings: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens", timings.get("cache_n", 0)) or 0)


def complete(address: tuple[str, int], prompt: str) -> dict[str, Any]:
    """One completion, max_tokens 1: its time is the time to first token."""
    t0 = time.perf_counter()
    body = json.loads(b"".join(line for _, line in _post(address, "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0})))
    usage = body.get("usage") or {}
    return {"ttft": time.perf_counter() - t0, "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "cached": _cached(usage, body.get("timings") or {})}


def chat(address: tuple[str, int], messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed chat turn: TTFT (the first content), the answer, its usage."""
    t0, first, text, usage, timings = time.perf_counter(), None, "", {}, {}
    for at, line in _post(address, "/v1/chat/completions", {
            "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}):
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        usage, timings = event.get("usage") or usage, event.get("timings") or timings
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = at
            text += piece
    return {"ttft": (first or time.perf_counter()) - t0, "answer": text,
            "prompt_tokens": int(usage.get("prompt_tokens", 0)), "cached": _cached(usage, timings)}


class Texts:
    """Novel texts, each used once: rotation prefixes, questions, system and user turns."""

    def __init__(self, model: Path, rotation_tokens: int, rounds: int) -> None:
        seeds = iter(range(200, 10_000))
        per_round = sum(ROTATIONS.values())
        self.prefixes = novel_prompts(model, rotation_tokens, [next(seeds) for _ in range(2 * per_round * rounds)])
        n_questions = 2 * rounds * per_round * PER_PREFIX
        self.questions = novel_prompts(model, 24, [next(seeds) for _ in range(n_questions)])
        n_chats = 2 * rounds * sum(CHATS.values())
        self.systems = novel_prompts(model, 300, [next(seeds) for _ in range(n_chats)])
        self.users = novel_prompts(model, 60, [next(seeds) for _ in range(n_chats * TURNS)])


def rotation(address: tuple[str, int], texts: Texts, k: int) -> list[dict[str, Any]]:
    prefixes = [texts.prefixes.pop() for _ in range(k)]
    out = []
    for i in range(PER_PREFIX * k):
        got = complete(address, prefixes[i % k] + " " + texts.questions.pop()[1:])
        out.append({**got, "prefix": i % k, "repeat": i >= k})
    return out


def chats(address: tuple[str, int], texts: Texts, k: int) -> list[dict[str, Any]]:
    talks = [[{"role": "system", "content": texts.systems.pop()}] for _ in range(k)]
    out = []
    for turn in range(TURNS):
        for c, msgs in enumerate(talks):
            msgs.append({"role": "user", "content": texts.users.pop()})
            got = chat(address, msgs)
            msgs.append({"role": "assistant", "content": got.pop("answer")})
            out.append({**got, "chat": c, "turn": turn + 1})
    return out


def run_case(case: str, launch: Launch, texts: Texts, cache_bytes: Callable[[Started], dict[str, float]] | None
             ) -> dict[str, Any]:
    with launch() as s:
        s.ready_s()
        rows = (rotation(s.address, texts, ROTATIONS[case]) if case in ROTATIONS
                else chats(s.address, texts, CHATS[case]))
        return {"requests": rows, **(cache_bytes(s) if cache_bytes else {})}


def run(launchers: dict[str, Launch], texts: Texts, rounds: int, cases: list[str],
        cache_bytes: Callable[[Started], dict[str, float]]) -> dict[str, Any]:
    """Every case on every server, `rounds` times, the servers' order alternating."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {c: [] for c in cases} for n in launchers}
    names = list(launchers)
    for r in range(rounds):
        for case in cases:
            for n in names[::1 if r % 2 == 0 else -1]:
                runs[n][case].append(run_case(case, launchers[n], texts, cache_bytes if n == "edge" else None))
    return {"runs": runs, "summary": {c: summarize(c, {n: runs[n][c] for n in names}) for c in cases}}


def summarize(case: str, by_server: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rounds in by_server.items():
        rows = [row for one in rounds for row in one["requests"]]
        out[name] = rotation_summary(rows) if case in ROTATIONS else chat_summary(rows)
        if rounds and "cache_bytes" in rounds[0]:
            out[name]["cache_bytes_max"] = max(one["cache_bytes"] for one in rounds)
            out[name]["cache_limit_bytes"] = rounds[0]["cache_limit_bytes"]
    if set(by_server) >= {"edge", "llama-server"}:
        key = "repeat_ttft" if case in ROTATIONS else "turn_ttft"
        e, p = out["edge"][key]["median"], out["llama-server"][key]["median"]
        out["edge_over_llama-server"] = round(e / p, 3) if p else None
    return out


def rotation_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    repeats = [r for r in rows if r["repeat"]]
    share = [r["cached"] / r["prompt_tokens"] for r in repeats if r["prompt_tokens"]]
    return {"repeats": len(repeats), "repeats_reusing_90pct": sum(s >= 0.9 for s in share),
            "reused_share": summary(share), "cached_tokens": summary([r["cached"] for r in repeats]),
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
            "repeat_ttft": summary([r["ttft"] for r in repeats]),
            "first_ttft": summary([r["ttft"] for r in rows if not r["repeat"]])}


def chat_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    turns = {t: [r for r in rows if r["turn"] == t] for t in range(1, TURNS + 1)}
    per_turn = {t: {"ttft": statistics.median(r["ttft"] for r in rs),
                     "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rs),
                     "cached": statistics.median(r["cached"] for r in rs)} for t, rs in turns.items()}
    last, second = per_turn[TURNS], per_turn[2]
    return {"per_turn": per_turn, "turn_ttft": summary([r["ttft"] for r in rows if r["turn"] > 1]),
            "last_over_second_ttft": round(last["ttft"] / second["ttft"], 3),
            "last_over_second_prompt": round(last["prompt_tokens"] / second["prompt_tokens"], 3)}


def table(summ: dict[str, Any], err: Any) -> None:
    for case, s in summ.items():
        print(f"\n{case}", file=err)
        for name, v in s.items():
            if not isinstance(v, dict):
                print(f"  edge / llama-server TTFT: {v}", file=err)
                continue
            if "cache_bytes_max" in v:
                print(f"  {name:13} prompt cache at most {v['cache_bytes_max'] / 2**20:.1f} MiB of "
                      f"{v['cache_limit_bytes'] / 2**20:.1f} MiB", file=err)
            if case in ROTATIONS:
                print(f"  {name:13} repeats >= 90 % reused: {v['repeats_reusing_90pct']}/{v['repeats']}, cached "
                      f"{v['cached_tokens']['median']:.0f}/{v['prompt_tokens']:.0f}, TTFT repeat "
                      f"{v['repeat_ttft']['median']:.3f} s, first {v['first_ttft']['median']:.3f} s", file=err)
            else:
                turns = ", ".join(f"{t}: {x['ttft']:.3f} s {x['cached']:.0f}/{x['prompt_tokens']:.0f}"
                                  for t, x in v["per_turn"].items())
                print(f"  {name:13} TTFT, cached/prompt per turn: {turns}; last/second TTFT "
                      f"{v['last_over_second_ttft']} (prompt x{v['last_over_second_prompt']})", file=err)
