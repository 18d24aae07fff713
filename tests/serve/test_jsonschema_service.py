"""json_schema and forced tool calls against a real `edge serve` (the tiny model): the patterns
that crashed the service are 400s naming the field and it serves on, integer bounds hold in the
output, a grammar llama.cpp refuses writes one line to the log (not the grammar), and none of it
is a 500 on /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.ggufgen import write_tiny_llama

httpx = pytest.importorskip("httpx")
from kit import EDGE, PidOne, write_config

TEMPLATE = ("{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}{{ eos_token }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HI = [{"role": "user", "content": "Hi"}]
CRASHERS = ["^a{,20000}$", "^a{,200000}$", "^a{0,20000}$", "^(a{0,100}){0,200}$"]
LITERAL = ["^a{0,+20000}$", "^a{+20000}$", "^a{20_000}$"]  # Python's re reads these as text, as edge does now


class Svc:
    def __init__(self, pid1: PidOne) -> None:
        self.pid1 = pid1
        self.base = f"http://{pid1.address[0]}:{pid1.address[1]}"

    def chat(self, **body: object) -> httpx.Response:
        return httpx.post(self.base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **body},
                          timeout=120)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("jsonschema-svc")
    config = write_config(d / "edge.toml", write_tiny_llama(d / "tools.gguf", chat_template=TEMPLATE), n_ctx=512)
    with PidOne([*EDGE, "serve", "--config", str(config)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        yield Svc(pid1)
        assert pid1.stop() == 0


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("pattern", CRASHERS)
def test_patterns_that_crashed_the_service_are_400s_and_it_serves_on(svc: Svc, pattern: str) -> None:
    r = svc.chat(response_format=schema_format({"type": "string", "pattern": pattern}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema", r.text
    assert "response_format.json_schema.pattern" in r.json()["error"]["message"] or "stacks" in r.text
    params = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}
    r = svc.chat(tools=tool(params), tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tools[0].function.parameters.properties.a.pattern" in r.json()["error"]["message"] or "stacks" in r.text
    assert svc.chat().status_code == 200


@pytest.mark.parametrize("pattern", LITERAL)
def test_braces_the_regex_reads_as_text_are_written_as_text(svc: Svc, pattern: str) -> None:
    import re

    r = svc.chat(response_format=schema_format({"type": "string", "pattern": pattern}), max_tokens=30)
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert re.search(pattern, json.loads(r.json()["choices"][0]["message"]["content"]))


def test_integer_bounds_hold_in_the_output(svc: Svc) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    seen = []
    for seed in range(8):
        r = svc.chat(response_format=schema_format(schema), max_tokens=40, temperature=1.5, seed=seed)
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "stop":
            seen.append(json.loads(r.json()["choices"][0]["message"]["content"])["age"])
    assert seen and all(0 <= age <= 120 for age in seen), seen


def test_refused_keywords_name_themselves(svc: Svc) -> None:
    r = svc.chat(response_format=schema_format({"type": "number", "multipleOf": 3}))
    assert r.status_code == 400 and "response_format.json_schema.multipleOf" in r.json()["error"]["message"]
    r = svc.chat(tools=tool({"type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}),
                 tool_choice="required")
    assert r.status_code == 400 and "tools[0].function.parameters.properties.n.maximum: " in r.text


def test_a_grammar_llama_cpp_would_refuse_is_a_400_and_not_the_grammar_in_the_log(svc: Svc) -> None:
    """llama.cpp's parser printed such a grammar whole (4 requests: 466 KB); the pattern is refused
    before it now (the refusal by llama.cpp itself: tests/model/test_grammar.py)."""
    before = svc.pid1.log_path.stat().st_size
    pattern = "^" + "a" * 60_000 + "\\xZZ$"  # no regex: \x wants two hex digits
    for _ in range(4):
        r = svc.chat(response_format=schema_format({"type": "string", "pattern": pattern}))
        assert r.status_code == 400 and "incomplete escape \\x at position 60001" in r.json()["error"]["message"], r.text
    written = svc.pid1.log_path.read_bytes()[before:]
    assert b"a" * 1000 not in written and len(written) < 8_000, len(written)  # it was 466 KB for 4
    assert svc.chat().status_code == 200


def test_a_huge_enum_is_refused_before_it_holds_the_model(svc: Svc) -> None:
    r = svc.chat(response_format=schema_format({"enum": [f"value-{i:06d}" for i in range(100_000)]}))
    assert r.status_code == 400 and "response_format.json_schema.enum: its values' JSON is" in r.text, r.text


def test_an_enum_of_a_thousand_values_answers_one_of_them(svc: Svc) -> None:
    values = [f"value-{i:03d}" for i in range(1000)]
    r = svc.chat(response_format=schema_format({"enum": values}), max_tokens=40, temperature=1.0, seed=3)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) in values


def test_a_pattern_with_classes_and_dots_answers_valid_json_that_matches_it(svc: Svc) -> None:
    import re

    pattern = "^[a-z]{2}[ -~]{4}$"  # [ -~] let a raw quote or backslash through before
    for seed in range(12):
        r = svc.chat(response_format=schema_format({"type": "string", "pattern": pattern}),
                     max_tokens=30, temperature=1.5, seed=seed)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
        assert re.fullmatch(pattern, json.loads(r.json()["choices"][0]["message"]["content"]))


def test_none_of_it_was_a_500(svc: Svc) -> None:
    text = httpx.get(svc.base + "/metrics", timeout=30).text
    assert 'code="500"' not in text and "Traceback" not in svc.pid1.log_path.read_text(errors="replace")
