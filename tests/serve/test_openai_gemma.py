"""The OpenAI API on the real model (Gemma 3 270M) through the official `openai` client against
a real `edge serve` subprocess: JSON output under a grammar, logit_bias on a known answer,
logprobs, a template without tools, concurrent streams."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest


openai = pytest.importorskip("openai")
from kit import EDGE, PidOne, write_config

pytestmark = pytest.mark.gemma

QUESTION = "Question: What is the capital of France?\nAnswer:"
HI = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


class Gemma:
    def __init__(self, pid1: PidOne) -> None:
        self.pid1 = pid1
        self.base = f"http://{pid1.address[0]}:{pid1.address[1]}/v1"
        # a queued stream is silent until its turn: the read timeout covers the whole queue
        self.client = openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=600)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=600)


def bad_request(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.param == param, err.value.body


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path):
    d = tmp_path_factory.mktemp("gemma-openai")
    # the packaged GGUF carries no chat template: Gemma 3's turn format, without tools
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                "{{ 'model' if m['role'] == 'assistant' else 'user' }}\\n{{ m['content'] }}"
                "<end_of_turn>\\n{% endfor %}<start_of_turn>model\\n")
    config = write_config(d / "edge.toml", gemma_path, n_ctx=1024,
                          extra_model=f'chat_template = "{template}"')
    config.write_text(config.read_text().replace('name = "tiny"', 'name = "gemma"'))
    with PidOne([*EDGE, "serve", "--config", str(config)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        yield Gemma(pid1)
        assert pid1.stop() == 0


def test_gemma_json_object_and_schema_outputs_parse(gemma: Gemma) -> None:
    ask = [{"role": "user", "content": "Describe France as a JSON object with keys capital and language."}]
    r = gemma.client.chat.completions.create(model="gemma", messages=ask, temperature=0, max_tokens=150,
                                             response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40},
                                               "population_millions": {"type": "integer"}},
              "required": ["capital", "population_millions"], "additionalProperties": False}
    r = gemma.client.chat.completions.create(
        model="gemma", messages=ask, temperature=0, max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"capital", "population_millions"} and isinstance(obj["population_millions"], int)


def test_gemma_integer_bounds_hold_where_the_model_would_answer_outside(gemma: Gemma) -> None:
    """The audit's repro: without the range, Gemma answered "age": 1900000000000000."""
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "How many years ago was the universe born? Answer as JSON with key age."}]
    for seed in range(3):
        r = gemma.client.chat.completions.create(
            model="gemma", messages=ask, temperature=1.0, seed=seed, max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        assert 0 <= json.loads(r.choices[0].message.content)["age"] <= 120


def test_gemma_logit_bias_bans_the_answer_and_logprobs_spell_the_text(gemma: Gemma,
                                                                      gemma_path: Path) -> None:
    import gguf

    def ask(**kw):
        return gemma.client.completions.create(model="gemma", prompt=QUESTION, max_tokens=4,
                                               temperature=0, stop=["\n"], **kw).choices[0]
    plain = ask(logprobs=2)
    assert "Paris" in plain.text and "".join(plain.logprobs.tokens).startswith(plain.text)
    f = gguf.GGUFReader(str(gemma_path)).fields["tokenizer.ggml.tokens"]
    paris = [n for n, i in enumerate(f.data) if bytes(f.parts[i]) in (b"\xe2\x96\x81Paris", b"Paris")]
    assert paris
    banned = ask(logit_bias={str(t): -100 for t in paris})
    assert "Paris" not in banned.text.split()[:1]


def test_gemma_template_without_tools_refuses_them_and_streams_finish(gemma: Gemma) -> None:
    if gemma.client.models.list().data[0].model_extra["meta"]["tools"]:
        r = gemma.client.chat.completions.create(model="gemma", messages=HI, tools=[TOOL],
                                                 tool_choice="required", max_tokens=60)
        assert r.choices[0].message.tool_calls[0].function.name == "weather"
    else:
        bad_request(lambda: gemma.client.chat.completions.create(
            model="gemma", messages=HI, tools=[TOOL]), "tools")

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": f"Count to {i + 2}."}], max_tokens=6,
            stream=True, stream_options={"include_usage": True})
        reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
        return next((r for r in reasons if r), None)

    async def all_of_them() -> list[str | None]:
        async with gemma.async_client() as client:
            return await asyncio.gather(*[one(client, i) for i in range(8)])

    assert all(r in ("stop", "length") for r in asyncio.run(all_of_them()))
