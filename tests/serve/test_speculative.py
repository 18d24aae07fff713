"""Speculative decoding through a real `edge serve` (kit.PidOne, port 0): one tiny model served
twice, speculation on (the default) and off. Greedy answers -- plain, streamed, `n` > 1, under a
JSON schema, with a stop string -- are the same from both; /metrics counts the proposals and
their acceptance per model; `edge status` names each model's setting. (The warm-up's speculative
candidate: tests/lifecycle/test_warmup.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kit import EDGE, metric, post, write_config

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "abc abc abc abc", "max_tokens": 60, "temperature": 0}),
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 40, "temperature": 0, "stream": True}),
    ("/v1/completions", {"prompt": "The list: apple, pear, plum.", "max_tokens": 40, "temperature": 0, "n": 2}),
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 40, "temperature": 0, "stop": ["RRRR"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a record"}], "max_tokens": 40,
                              "temperature": 0, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "r", "schema": SCHEMA}}}),
]


def _answer(status: int, body: Any) -> Any:
    assert status == 200, body
    if isinstance(body, str):  # streamed: the text of its events
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        return "".join(e["choices"][0]["text"] for e in events)
    return [(c.get("text") or c["message"]["content"], c["finish_reason"]) for c in body["choices"]]


def test_answers_are_the_same_with_and_without_speculation(tmp_path: Path, tiny_gguf: Path, service) -> None:
    plain = f'[[models]]\nname = "plain"\npath = "{tiny_gguf}"\nn_ctx = 512\n[models.speculative]\nmode = "off"\n'
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512, extra=plain)
    live = service(cfg)
    a = live.address
    warm = metric(a, "edge_speculative_drafted_tokens_total", model="tiny")
    for path, body in REQUESTS:
        on = _answer(*post(a, path, {**body, "model": "tiny"}))
        off = _answer(*post(a, path, {**body, "model": "plain"}))
        assert on == off, (path, body)
    drafted = metric(a, "edge_speculative_drafted_tokens_total", model="tiny")
    accepted = metric(a, "edge_speculative_accepted_tokens_total", model="tiny")
    assert drafted > warm and 0 < accepted <= drafted
    assert metric(a, "edge_speculative_acceptance_ratio", model="tiny") == accepted / drafted
    assert metric(a, "edge_speculative_drafted_tokens_total", model="plain") == 0
    shown = subprocess.run([*EDGE, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = {name: [line for line in shown.stdout.splitlines() if line.startswith(f"model {name}:")]
             for name in ("tiny", "plain")}  # each model's lines: its context, its memory
    assert any("speculative ngram (2-4-grams, up to 8 tokens" in line for line in lines["tiny"]), lines
    assert any("speculative off" in line for line in lines["plain"]), lines
