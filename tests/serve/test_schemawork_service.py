"""Issue 39's requests against a real `edge serve` (the tiny model, `request_timeout_s = 5`): the
nested-anyOf family and the patterns that held the model are 400s naming the field before
anything compiles, the request queued behind each is served, and SIGTERM during the heaviest
schema edge accepts lets the service exit within `request_timeout_s` + 2 s."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from harness.ggufgen import write_tiny_llama
from kit import metric, post, write_config
from kit.schemagen import nested_any_of

TIMEOUT_S = 5.0  # generous: the tiny model on a loaded 2-core machine
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}



def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}


N_CTX = 32768  # room for a generation the limit ends: ~1,700 tokens/s under the heaviest schema here, quiet


@pytest.fixture
def svc(tmp_path: Path, service):
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_ctx=N_CTX)
    cfg = write_config(tmp_path / "edge.toml", model, n_ctx=N_CTX)
    cfg.write_text(cfg.read_text().replace("[server]\n", f"[server]\nrequest_timeout_s = {TIMEOUT_S}\n", 1))
    return service(cfg)


@pytest.mark.parametrize("schema", [nested_any_of(2, 256), nested_any_of(3, 256), nested_any_of(3, 64),
                                    nested_any_of(5, 8), {"type": "string", "pattern": "^(a?){0,900}$"},
                                    {"type": "string", "pattern": "^(a?)*$"}])
def test_the_family_is_a_400_and_the_queued_request_is_served(svc, schema: dict) -> None:
    queued: dict[str, tuple] = {}
    t0 = time.monotonic()
    behind = threading.Thread(target=lambda: queued.update(answer=post(svc.address, "/v1/chat/completions", HI)))
    behind.start()
    status, body = post(svc.address, "/v1/chat/completions", {**HI, "response_format": fmt(schema)})
    behind.join(60)
    assert status == 400 and body["error"]["param"] == "response_format.json_schema", body
    assert queued["answer"][0] == 200 and time.monotonic() - t0 < TIMEOUT_S + 0.5, queued
    assert metric(svc.address, "edge_requests_total", status="500") == 0


def test_sigterm_during_the_heaviest_accepted_schema_exits_within_the_request_limit(svc) -> None:
    keys = [f"{chr(97 + i % 26)}{i:03d}" for i in range(128)]  # 128 objects at once: 256 stacks, MAX_STACKS
    schema = {"type": "array", "minItems": 1000, "items": {"anyOf": [
        {"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in keys]}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": N_CTX - 100, "temperature": 1.0, "seed": 1,
            "stream": True, "response_format": fmt(schema)}
    c = http.client.HTTPConnection(*svc.address, timeout=60)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: {")  # generating now
    t0 = time.monotonic()
    ended: list[bytes] = []

    def client() -> None:  # reads the stream to its end, then leaves (no idle keep-alive to wait for)
        while (line := r.readline()) and not line.startswith(b"data: [DONE]"):
            ended.append(line)
        c.close()

    reader = threading.Thread(target=client)
    reader.start()
    assert svc.stop(timeout=30) == 0
    exited = time.monotonic() - t0
    reader.join(30)
    assert exited < TIMEOUT_S + 2, exited
    assert any(b'"generation_timeout"' in line for line in ended), ended[-3:]  # ended by its limit
    assert "Traceback" not in svc.log_tail(100_000)
