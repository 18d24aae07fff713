"""Live fuzzing with a fixed seed: random schemas (kit.schemagen) as `response_format` and as a
forced tool's parameters, random sampling, against a real `edge serve` on the tiny model. Every
answer is a 200 whose finished output the `jsonschema` validator accepts, or a 400 naming the
field; the service stays up, no 500 on /metrics, no traceback in its log."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from harness.ggufgen import write_tiny_llama
from kit import EDGE, PidOne, metric, post, write_config
from kit.schemagen import SchemaGen

jsonschema = pytest.importorskip("jsonschema")
TEMPLATE = ("{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}{{ eos_token }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REQUESTS = 60


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


def body(rng: random.Random, schema: dict, as_tool: bool) -> dict:
    b = {"messages": [{"role": "user", "content": rng.choice(["Hi", "json please", "the a e"])}],
         "max_tokens": rng.choice([16, 48, 96]), "temperature": rng.choice([0, 0.7, 1.5]), "seed": rng.randint(0, 99)}
    if as_tool:
        return {**b, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required"}
    return {**b, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def finished_output(answer: dict, as_tool: bool) -> object:
    message = answer["choices"][0]["message"]
    if as_tool:
        return json.loads(message["tool_calls"][0]["function"]["arguments"])
    return json.loads(message["content"])


def test_random_schemas_get_valid_outputs_or_400s(pid1: PidOne) -> None:
    rng, gen = random.Random(3939), SchemaGen(random.Random(39))
    counts = {"valid": 0, "length": 0, "400": 0}
    cls = jsonschema.Draft202012Validator
    for i in range(REQUESTS):
        schema, as_tool = gen.schema(), i % 3 == 2
        if as_tool:  # a tool's parameters are an object (its arguments' JSON text is the answer)
            schema = {"type": "object", "properties": {"p": schema}, "required": ["p"],
                      **({"$defs": schema.pop("$defs")} if "$defs" in schema else {})}
        status, answer = post(pid1.address, "/v1/chat/completions", body(rng, schema, as_tool), timeout=120)
        if status == 400:
            assert answer["error"]["param"] == ("tools" if as_tool else "response_format.json_schema"), answer
            counts["400"] += 1
            continue
        assert status == 200, (status, answer, schema)
        reason = answer["choices"][0]["finish_reason"]
        if reason == "length":  # cut before the end: not an output the grammar finished
            counts["length"] += 1
            continue
        assert reason == ("tool_calls" if as_tool else "stop"), answer
        try:
            value = finished_output(answer, as_tool)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise AssertionError(f"not the JSON asked for: {exc}: {answer}, {schema}") from None
        errors = [e.message for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)]
        assert errors == [], (schema, value, errors)
        counts["valid"] += 1
    assert counts["valid"] >= REQUESTS // 4 and counts["400"] < REQUESTS // 4, counts
    assert post(pid1.address, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2})[0] == 200
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    assert "Traceback" not in pid1.log_tail(1_000_000)
