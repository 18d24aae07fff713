"""Many clients at once against a real `edge serve` (kit.PidOne, 127.0.0.1, port 0) with the tiny
model's 4 slots: 16 clients mixing plain, streamed, `n` > 1, JSON-schema (grammar) requests,
clients that leave mid-stream and requests that run past `request_timeout_s`. No request fails:
each gets its answer, or the documented 422 `generation_timeout`; afterwards every slot is free,
nothing is queued, and greedy answers are the same as a lone client's."""

from __future__ import annotations

import concurrent.futures
import json
import socket
from pathlib import Path
from typing import Any

from kit import metric, post, write_config

CLIENTS = 16
PLAIN = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _stream_and_leave(address: tuple[str, int]) -> str:
    """A streamed request whose client reads its head and first bytes, then closes."""
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0.8,
                       "stream": True}).encode()
    with socket.create_connection(address, timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200"), first[:100]
    return "left"


def _client(address: tuple[str, int], i: int) -> list[str]:
    """Each client: two requests of its kind (i % 6); the outcome of each."""
    out = []
    for _ in range(2):
        kind = i % 6
        if kind == 5:
            out.append(_stream_and_leave(address))
            continue
        body: dict[str, Any] = dict(PLAIN)
        path = "/v1/completions"
        if kind == 1:
            body["stream"] = True
        elif kind == 2:
            body["n"] = 3
        elif kind == 3:
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "a number"}], "max_tokens": 24, "temperature": 0.5,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
        elif kind == 4:
            body = {"prompt": "tea and a world", "max_tokens": 480, "temperature": 0.9}  # long: may time out
        status, answer = post(address, path, body)
        out.append(_outcome(kind, status, answer))
    return out


def _outcome(kind: int, status: int, answer: Any) -> str:
    if status == 422 and answer["error"]["code"] == "generation_timeout":
        return "timeout"
    assert status == 200, (kind, status, answer)
    if kind == 1:
        events = [line[6:] for line in answer.splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events[:-1] if e.startswith('{"error"')]
        assert events[-1] == "[DONE]" and all(e["code"] == "generation_timeout" for e in errors), events[-3:]
        return "timeout" if errors else "streamed"
    if kind == 2:
        texts = {c["text"] for c in answer["choices"]}
        assert len(answer["choices"]) == 3 and len(texts) == 1  # greedy: three equal choices
        return "n3"
    return "ok"


def test_sixteen_clients_mixing_everything_fail_no_request(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=1024, extra_model="parallel = 4")
    cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nrequest_timeout_s = 2.0\n", 1))
    live = service(cfg)
    status, lone = post(live.address, "/v1/completions", PLAIN)
    assert status == 200, lone
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = [o for os_ in pool.map(lambda i: _client(live.address, i), range(CLIENTS)) for o in os_]
    assert len(outcomes) == 2 * CLIENTS and set(outcomes) <= {"ok", "streamed", "n3", "timeout", "left"}
    assert outcomes.count("left") == 2 * (CLIENTS // 6)
    # the slots drained: nothing running or queued, and a lone request answers as before
    status, again = post(live.address, "/v1/completions", PLAIN)
    assert status == 200 and again["choices"][0]["text"] == lone["choices"][0]["text"]
    a = live.address
    assert metric(a, "edge_queue_depth", model="tiny", kind="model") == 0
    assert metric(a, "edge_slots_busy", model="tiny") == 0 and metric(a, "edge_slots", model="tiny") == 4
    # steps held several sequences at once
    assert metric(a, "edge_batch_sequences_total", model="tiny") > metric(a, "edge_batch_steps_total", model="tiny")
