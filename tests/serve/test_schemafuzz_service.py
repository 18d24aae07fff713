"""Live fuzzing with a fixed seed: random schemas (kit.schemagen, issue 56's constructs among
them) as `response_format` and as forced tools' parameters (`required` and a named function, one
tool or two), greedy and sampled, some with `logit_bias` pushing the bytes llama.cpp's grammar
lets through (a surrogate's, overlong leads, lone continuation bytes, quotes), against a real
`edge serve` on the tiny model. Every answer is a 200 whose finished output is strict UTF-8,
strict JSON and valid by the `jsonschema` validator (kit.schemacheck), or a 400 naming the field;
a forced call is always `tool_calls`, cut or not; the service stays up, no 500 on /metrics, no
traceback in its log."""

from __future__ import annotations

import json
import random

import pytest

from harness.ggufgen import byte_token, write_tiny_llama
from kit import EDGE, PidOne, metric, post, write_config
from kit.schemacheck import invalid
from kit.schemagen import SchemaGen

pytest.importorskip("jsonschema")
TEMPLATE = ("{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}{{ eos_token }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REQUESTS = 60
PUSHED = [0xED, 0xA0, 0xC0, 0xC1, 0xF5, 0xFF, 0x80, 0xBF, 0xE0, 0xF0, 0x22]  # what the guard must turn down


@pytest.fixture(scope="module")
def pid1(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("schemafuzz")
    config = write_config(d / "edge.toml", write_tiny_llama(d / "tiny.gguf", chat_template=TEMPLATE, n_ctx=4096),
                          n_ctx=4096)
    with PidOne([*EDGE, "serve", "--config", str(config)]) as p:
        p.start()
        p.wait_for("READY", "1", timeout=120)
        yield p
        assert p.stop() == 0


def tool_params(schema: dict) -> dict:
    """A schema as a tool's parameters: an object (its arguments' JSON text is the answer)."""
    return {"type": "object", "properties": {"p": schema}, "required": ["p"],
            **({"$defs": schema.pop("$defs")} if "$defs" in schema else {})}


def body(rng: random.Random, schema: dict, tools: list[dict] | None) -> dict:
    b = {"messages": [{"role": "user", "content": rng.choice(["Hi", "json please", "the a e"])}],
         "max_tokens": rng.choice([16, 48, 96]), "temperature": rng.choice([0, 0.7, 1.5]), "seed": rng.randint(0, 99)}
    if rng.random() < 0.35:
        b["logit_bias"] = {str(byte_token(x)): rng.choice([5, 20, 100]) for x in rng.sample(PUSHED, 3)}
    if tools is not None:
        choice = "required" if rng.random() < 0.5 else {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        return {**b, "tools": tools, "tool_choice": choice}
    return {**b, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def checked(answer: dict, schema: dict | None, tools: list[dict] | None) -> str:
    """valid | length: the choice's output as the client got it, held to its schema."""
    choice = answer["choices"][0]
    message, reason = choice["message"], choice["finish_reason"]
    if tools is None:
        assert reason in ("stop", "length"), answer
        if reason == "length":
            return "length"
        assert invalid(schema, message["content"]) is None, (schema, message, invalid(schema, message["content"]))
        return "valid"
    (call,) = message["tool_calls"]  # never prose: `tool_calls` cut or not
    assert message["content"] is None and reason in ("tool_calls", "length"), answer
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["function"]["name"] in params, answer
    if reason == "length":
        return "length"
    why = invalid(params[call["function"]["name"]], call["function"]["arguments"])
    assert why is None, (params, call, why)
    return "valid"


def test_random_schemas_get_valid_outputs_or_400s(pid1: PidOne) -> None:
    rng, gen = random.Random(3939), SchemaGen(random.Random(39))
    counts = {"valid": 0, "length": 0, "400": 0, "tools": 0}
    for i in range(REQUESTS):
        schema, tools = gen.schema(), None
        if i % 3 == 2:
            tools = [{"type": "function", "function": {"name": "f", "parameters": tool_params(schema)}}]
            if rng.random() < 0.5:
                tools.append({"type": "function", "function": {"name": "g", "parameters": tool_params(gen.schema())}})
            rng.shuffle(tools)
        status, answer = post(pid1.address, "/v1/chat/completions", body(rng, schema, tools), timeout=120)
        if status == 400:
            assert answer["error"]["param"] == ("tools" if tools else "response_format.json_schema"), answer
            counts["400"] += 1
            continue
        assert status == 200, (status, answer, schema)
        counts[checked(answer, schema, tools)] += 1
        counts["tools"] += tools is not None
    assert counts["valid"] >= REQUESTS // 4 and counts["400"] < REQUESTS // 2 and counts["tools"] >= 8, counts
    assert post(pid1.address, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2})[0] == 200
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    assert "Traceback" not in pid1.log_tail(1_000_000)
