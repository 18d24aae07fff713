"""The OpenAI API through the official `openai` client against a real `edge serve` subprocess.

Each honored field's effect is observed; each refused field is a 400 naming it. The tiny models
(scripts/harness/ggufgen.py) produce noise, so effects are checked by comparing requests with each other
(greedy output with and without the field), never against fixed text.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from harness.ggufgen import write_tiny_llama

openai = pytest.importorskip("openai")
from kit import EDGE, PidOne, write_config

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CITY_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                "sunny": {"type": "boolean"}},
               "required": ["city", "sunny"], "additionalProperties": False}
HI = [{"role": "user", "content": "Hello"}]


class Service:
    """`edge serve` as a subprocess on a socket bound to 127.0.0.1:0, and clients for it."""

    def __init__(self, pid1: PidOne, config: Path, timeout: float = 120) -> None:
        self.pid1, self.config, self.timeout = pid1, config, timeout
        self.base = f"http://{pid1.address[0]}:{pid1.address[1]}/v1"
        self.client = openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=timeout)

    def async_client(self) -> openai.AsyncOpenAI:
        # a queued stream is silent until its turn: the read timeout covers the whole queue
        return openai.AsyncOpenAI(base_url=self.base, api_key="none", max_retries=0,
                                  timeout=self.timeout)

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(self.base.removesuffix("/v1") + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def serve(tmp: Path, model: Path, max_queue: int = 64, **kw: str) -> Service:
    config = write_config(tmp / "edge.toml", model, n_ctx=512, **kw)
    config.write_text(config.read_text().replace("port = 0", f"port = 0\nmax_queue = {max_queue}", 1))
    pid1 = PidOne([*EDGE, "serve", "--config", str(config)])
    pid1.__enter__()
    pid1.start()
    pid1.wait_for("READY", "1", timeout=120)
    return Service(pid1, config)


def stop(svc: Service) -> None:
    assert svc.pid1.stop() == 0
    svc.pid1.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    svc = serve(tmp_path_factory.mktemp("tiny-svc"), tiny_gguf, extra_model="max_choices = 4")
    yield svc
    stop(svc)


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tools-svc")
    svc = serve(d, write_tiny_llama(d / "tools.gguf", chat_template=TOOLS_TEMPLATE))
    yield svc
    stop(svc)


def greedy(svc: Service, **kw):
    return svc.client.completions.create(model="tiny", prompt=kw.pop("prompt", "Hello world"),
                                         temperature=0, **{"max_tokens": 12, **kw})


def bad_request(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400 and err.value.param == param, err.value.body
    return str(err.value)


def test_models_carry_created_owner_and_context_length(tiny: Service) -> None:
    (m,) = tiny.client.models.list().data
    assert m.id == "tiny" and m.owned_by == "edge" and m.created > 0
    assert m.model_extra["context_length"] == 512


def test_max_completion_tokens_takes_precedence_over_max_tokens(tiny: Service) -> None:
    r = tiny.client.chat.completions.create(model="tiny", messages=HI, temperature=0,
                                            max_tokens=40, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3
    r = tiny.client.chat.completions.create(model="tiny", messages=HI, temperature=0, max_tokens=5)
    assert r.usage.completion_tokens <= 5


def test_stop_cuts_the_greedy_text_where_the_stop_string_starts(tiny: Service) -> None:
    fresh = {"extra_body": {"cache_prompt": False}}  # both from position 0: the same computation
    text = greedy(tiny, max_tokens=30, **fresh).choices[0].text
    stop = text[6:8]
    r = greedy(tiny, max_tokens=30, stop=[stop, "\x00never"], **fresh)
    assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_repeatable_and_different_seeds_differ(tiny: Service) -> None:
    def sample(seed: int) -> str:
        return tiny.client.completions.create(model="tiny", prompt="Hello", temperature=1.5,
                                              max_tokens=12, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(1, 6)}) > 1


def test_frequency_and_presence_penalties_change_a_repetitive_greedy_text(tiny: Service) -> None:
    base = greedy(tiny, max_tokens=40, logprobs=0).choices[0]
    assert len(set(base.logprobs.tokens)) < len(base.logprobs.tokens)  # greedy repeats itself
    assert greedy(tiny, max_tokens=40, frequency_penalty=2.0).choices[0].text != base.text
    assert greedy(tiny, max_tokens=40, presence_penalty=2.0).choices[0].text != base.text
    bad_request(lambda: greedy(tiny, presence_penalty=2.5), "presence_penalty")
    bad_request(lambda: greedy(tiny, frequency_penalty=-3), "frequency_penalty")


def test_completion_logprobs_are_the_chosen_tokens(tiny: Service) -> None:
    c = greedy(tiny, max_tokens=10, logprobs=3).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0  # a dict: alternatives that print alike merge
        assert chosen == pytest.approx(max(top.values()))  # greedy: the likeliest one
        assert top[tok] == pytest.approx(chosen)
    # counted from the prompt's start, as OpenAI and llama-cpp-python count
    assert lp.text_offset[0] == len("Hello world") and lp.text_offset == sorted(lp.text_offset)
    assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t) for t in lp.tokens[:-1]]
    two = greedy(tiny, prompt=["Hi", "Hello world"], max_tokens=3, logprobs=1, stream=True)
    firsts = {}
    for chunk in two:
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.text_offset:
                firsts.setdefault(ch.index, ch.logprobs.text_offset[0])
    assert firsts == {0: 2, 1: len("Hello world")}
    bad_request(lambda: greedy(tiny, logprobs=6), "logprobs")


def test_chat_logprobs_streamed_and_whole_match_the_content(tiny: Service) -> None:
    # cache_prompt false: the whole answer and the streamed one are the same computation (from
    # position 0, the same batches), so the same tokens on any CPU; a prefix reused from the cache
    # would be another one, llama.cpp's to round (tests/kit/replay.py)
    kw = dict(model="tiny", messages=HI, max_tokens=8, logprobs=True, top_logprobs=2,
              extra_body={"cache_prompt": False})
    whole = tiny.client.chat.completions.create(temperature=0, **kw).choices[0]
    content = whole.logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == whole.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    sampled = tiny.client.chat.completions.create(temperature=1.5, seed=3, **kw).choices[0]
    for t in sampled.logprobs.content:  # sampling may pick any token, never a likelier one than top
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-6
    streamed = [c for c in tiny.client.chat.completions.create(temperature=0, stream=True, **kw)
                if c.choices and c.choices[0].logprobs]
    assert [t.token for c in streamed for t in c.choices[0].logprobs.content] == [t.token for t in content]
    bad_request(lambda: tiny.client.chat.completions.create(model="tiny", messages=HI, top_logprobs=2),
                "top_logprobs")
    bad_request(lambda: tiny.client.chat.completions.create(model="tiny", messages=HI, logprobs=True,
                                                            top_logprobs=21), "top_logprobs")


def test_echo_puts_the_prompt_before_the_completion(tiny: Service) -> None:
    plain = greedy(tiny, prompt="Hello").choices[0].text
    assert greedy(tiny, prompt="Hello", echo=True).choices[0].text == "Hello" + plain
    bad_request(lambda: greedy(tiny, echo=True, logprobs=1), "echo")


def test_logit_bias_minus_100_removes_the_greedy_token(tiny: Service, tiny_gguf: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(tiny_gguf))
    f = reader.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(f.parts[i]).decode() for i in f.data]
    first = greedy(tiny, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]

    def text(t: str) -> str:
        return chr(int(t[3:5], 16)) if t.startswith("<0x") else t.replace("\u2581", " ")
    ids = [i for i, t in enumerate(vocab) if text(t) in (first, first.strip()) and text(t)]
    assert ids
    banned = greedy(tiny, max_tokens=1, logprobs=0, logit_bias={str(i): -100 for i in ids})
    assert banned.choices[0].logprobs.tokens[0] != first
    bad_request(lambda: greedy(tiny, logit_bias={"99999": -1}), "logit_bias")
    bad_request(lambda: greedy(tiny, logit_bias={"3": -101}), "logit_bias")


def test_json_schema_output_parses_and_matches(tiny: Service) -> None:
    r = tiny.client.chat.completions.create(
        model="tiny", messages=HI, temperature=0.8, seed=1, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": CITY_SCHEMA}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"city", "sunny"} and obj["city"] in ("Paris", "Oslo")
    assert isinstance(obj["sunny"], bool)
    bad_request(lambda: tiny.client.chat.completions.create(
        model="tiny", messages=HI, response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}),
        "response_format.json_schema")
    bad_request(lambda: tiny.client.chat.completions.create(
        model="tiny", messages=HI, response_format={"type": "xml"}), "response_format.type")


def test_a_schema_answer_with_its_end_tokens_banned_stops_and_the_service_serves_on(tiny: Service,
                                                                                  tiny_gguf: Path) -> None:
    """Once the JSON is whole, the grammar allows only an end-of-generation token; logit_bias
    bans them all. llama.cpp's grammar aborts the process when made to accept any other token:
    the answer ends there instead ("stop"), and the service serves on."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(tiny_gguf), vocab_only=True, verbose=False)
    try:
        v = vocab._model.vocab
        ends = [t for t in range(llama_cpp.llama_vocab_n_tokens(v)) if llama_cpp.llama_vocab_is_eog(v, t)]
    finally:
        vocab.close()
    for temperature in (0, 0.8):
        r = tiny.client.chat.completions.create(
            model="tiny", messages=HI, temperature=temperature, seed=3, max_tokens=200,
            logit_bias={str(t): -100 for t in ends},
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": CITY_SCHEMA}})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 200
        assert set(json.loads(r.choices[0].message.content)) == {"city", "sunny"}
    assert greedy(tiny).choices[0].text


def test_include_usage_sends_a_last_usage_chunk(tiny: Service) -> None:
    chunks = list(tiny.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    plain = list(tiny.client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, stream=True))
    assert all(c.usage is None for c in plain)


def test_content_parts_are_text_and_others_are_refused(tiny: Service) -> None:
    def chat(content):
        return tiny.client.chat.completions.create(model="tiny", temperature=0, max_tokens=8,
                                                   messages=[{"role": "user", "content": content}])
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert chat(parts).choices[0].message.content == chat("Hello").choices[0].message.content
    bad_request(lambda: chat([{"type": "image_url", "image_url": {"url": "data:,"}}]),
                "messages[0].content[0].type")


def _tokenize(model: Path, text: str) -> list[int]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    return vocab.tokenize(text.encode(), add_bos=True, special=True)


def test_prompt_lists_and_token_ids_give_choices_in_order(tiny: Service, tiny_gguf: Path) -> None:
    one = greedy(tiny, prompt="Hello").choices[0].text
    two = greedy(tiny, prompt="Hello world").choices[0].text
    r = greedy(tiny, prompt=["Hello", "Hello world"])
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [one, two]
    tokens = _tokenize(tiny_gguf, "Hello")
    assert greedy(tiny, prompt="Hello").usage.prompt_tokens == len(tokens)
    ids = greedy(tiny, prompt=[tokens, tokens[:3]], echo=True)
    assert ids.choices[0].text.endswith(one) and ids.usage.prompt_tokens == len(tokens) + 3
    assert [c.index for c in ids.choices] == [0, 1]
    bad_request(lambda: greedy(tiny, prompt=[[1, 10**6]]), "prompt")


def test_n_choices_are_generated_and_bounded(tiny: Service) -> None:
    r = tiny.client.chat.completions.create(model="tiny", messages=HI, n=3, max_tokens=6,
                                            temperature=1.5, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    stream = tiny.client.chat.completions.create(model="tiny", messages=HI, n=2, max_tokens=4, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    bad_request(lambda: tiny.client.chat.completions.create(model="tiny", messages=HI, n=5), "n")
    bad_request(lambda: greedy(tiny, prompt=["a", "b", "c"], n=2), "n")


@pytest.mark.parametrize("kw, param", [
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"frobnicate": None}}, "frobnicate"),  # null is no way around the rule
    ({"extra_body": {"metadata": None}}, "metadata"),  # a chat field: unknown to completions
    ({"extra_body": {"store": True}}, "store"),
    ({"extra_body": {"service_tier": "flex"}}, "service_tier"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_refused_completion_fields_name_themselves(tiny: Service, kw: dict, param: str) -> None:
    bad_request(lambda: greedy(tiny, **kw), param)


@pytest.mark.parametrize("kw, param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"extra_body": {"echo": True}}, "echo"),
    ({"extra_body": {"frobnicate": None}}, "frobnicate"),
    ({"tools": [CITY_TOOL]}, "tools"),
])
def test_refused_chat_fields_name_themselves(tiny: Service, kw: dict, param: str) -> None:
    message = bad_request(lambda: tiny.client.chat.completions.create(model="tiny", messages=HI, **kw),
                          param)
    if param == "tools":
        assert "template has no tool support" in message


def test_fields_ignored_on_purpose_are_accepted(tiny: Service) -> None:
    r = tiny.client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, user="u-1",
                                            store=False, metadata={"k": "v"}, service_tier="auto",
                                            extra_body={"safety_identifier": "sid-7"})
    assert r.choices[0].finish_reason in ("stop", "length")
    # docs/api.md: both are logged with the request
    assert "request from user 'u-1', safety_identifier 'sid-7'" in tiny.pid1.log_tail(100_000)


def test_known_fields_may_be_null_unknown_ones_may_not() -> None:
    from edge.errors import RequestError
    from edge.serve.openai import Limits, parse

    limits = Limits(n_ctx=512, n_vocab=100, max_n=4, tools=False)
    # null for a field edge knows is its default: honored, ignored-on-purpose and refused alike
    ask = parse({"messages": HI, "seed": None, "user": None, "metadata": None, "audio": None,
                 "safety_identifier": None}, True, limits)
    assert ask.sampling["seed"] is None and ask.who == {}
    assert parse({"prompt": "x", "suffix": None, "best_of": None, "user": None}, False, limits).prompts == ["x"]
    for chat, body in ((False, {"prompt": "x", "foo": None}), (True, {"messages": HI, "foo": None}),
                       (False, {"prompt": "x", "safety_identifier": None})):
        with pytest.raises(RequestError) as err:
            parse(body, chat, limits)
        assert err.value.param in ("foo", "safety_identifier") and "unknown field" in str(err.value)


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_nan_is_no_number_for_any_sampling_field(tiny: Service, field: str) -> None:
    import httpx

    # Python's json (and so any client built on it) writes NaN; every range check passed it
    for path, body in (("/completions", '{"prompt": "x", "max_tokens": 1, "%s": NaN}'),
                       ("/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "%s": NaN}')):
        r = httpx.post(tiny.base + path, content=(body % field).encode(),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "finite" in r.json()["error"]["message"]


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "minLength": 10**9}, ".minLength"),
    ({"type": "array", "items": {"type": "string", "maxLength": 10**6}}, ".items.maxLength"),
    ({"type": "string", "pattern": "^a{99999999}$"}, ".pattern"),
    ({"type": "string", "pattern": "^((ab{100}){100}){10001}$"}, ".pattern"),
])
def test_a_schema_that_would_repeat_past_the_limit_is_a_400_and_the_service_serves_on(
        tiny: Service, schema: dict, where: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    message = bad_request(lambda: tiny.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=2, response_format=fmt), "response_format.json_schema")
    assert f"response_format.json_schema{where}: " in message and "10000" in message
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^(a{3}b){4}$"}}}
    r = tiny.client.chat.completions.create(model="tiny", messages=HI, max_tokens=40, response_format=ok)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("chat, body, param", [
    (False, {"prompt": "x", "logit_bias": {"1_0": 5}}, "logit_bias"),  # int() reads 10
    (False, {"prompt": "x", "logit_bias": {"\u0661": 5}}, "logit_bias"),  # an Arabic-Indic 1
    (False, {"prompt": "x", "logit_bias": {" 1": 5}}, "logit_bias"),
    (True, {"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
    (True, {"messages": HI, "parallel_tool_calls": "x"}, "parallel_tool_calls"),
    (True, {"messages": HI, "metadata": 5}, "metadata"),
    (True, {"messages": HI, "prompt_cache_key": 5}, "prompt_cache_key"),
    (True, {"messages": HI, "response_format": {"type": "text", "foo": 1}}, "response_format.foo"),
    (True, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "foo": 1}}}, "response_format.json_schema.foo"),
    (True, {"messages": HI, "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
])
def test_fields_inside_fields_are_checked_too(chat: bool, body: dict, param: str) -> None:
    from edge.errors import RequestError
    from edge.serve.openai import Limits, parse

    with pytest.raises(RequestError) as err:
        parse(body, chat, Limits(n_ctx=512, n_vocab=100, max_n=4, tools=False))
    assert err.value.param == param, str(err.value)


def test_an_assistant_message_sent_back_as_the_client_got_it_is_accepted(tiny: Service) -> None:
    first = tiny.client.chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    echoed = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call...
    r = tiny.client.chat.completions.create(model="tiny", max_tokens=3, messages=[
        *HI, echoed, {"role": "user", "content": "again"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_tool_choice_naming_its_function_wrongly_is_a_400() -> None:
    from edge.errors import RequestError
    from edge.serve.openai import Limits, parse

    limits = Limits(n_ctx=512, n_vocab=100, max_n=4, tools=True)
    for choice in ({"type": "function", "function": "get_weather"}, {"type": "function", "function": 5},
                   {"type": "function"}, {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(RequestError) as err:
            parse({"messages": HI, "tools": [CITY_TOOL], "tool_choice": choice}, True, limits)
        assert err.value.param == "tool_choice" and "must name one of the tools" in str(err.value)


def test_a_forced_tool_call_is_parsed_into_tool_calls(tools: Service) -> None:
    r = tools.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[CITY_TOOL],
        tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    streamed = list(tools.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[CITY_TOOL],
        tool_choice="required", max_tokens=80, temperature=0, stream=True))
    calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "weather"
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_through_the_template(tools: Service, tiny: Service) -> None:
    history = [{"role": "user", "content": "weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = tools.client.chat.completions.create(model="tiny", messages=history, tools=[CITY_TOOL],
                                             max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad_request(lambda: tiny.client.chat.completions.create(model="tiny", messages=history), "messages[1]")


def test_eight_concurrent_async_streams_all_finish(tiny: Service) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=16, stream=True)
        reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
        return next((r for r in reasons if r), None)

    async def all_of_them() -> list[str | None]:
        async with tiny.async_client() as client:
            return await asyncio.gather(*[one(client, i) for i in range(8)])

    assert all(r in ("stop", "length") for r in asyncio.run(all_of_them()))


def test_a_stream_past_max_queue_is_a_503_before_any_byte(tmp_path: Path, tiny_gguf: Path) -> None:
    svc = serve(tmp_path, tiny_gguf, max_queue=1)
    try:
        async def one(client: openai.AsyncOpenAI) -> int:
            try:
                stream = await client.completions.create(model="tiny", prompt="Hello", max_tokens=200,
                                                         stream=True)
            except openai.APIStatusError as exc:
                assert exc.response.headers["retry-after"] == "1"
                return exc.status_code
            chunks = [c async for c in stream]
            assert any(c.choices[0].finish_reason for c in chunks)
            return 200

        async def burst() -> list[int]:
            async with svc.async_client() as client:
                return await asyncio.gather(*[one(client) for _ in range(8)])

        codes = asyncio.run(burst())
        assert 200 in codes and 503 in codes and set(codes) == {200, 503}
    finally:
        stop(svc)


def test_a_client_leaving_a_queued_request_is_an_abort_and_never_runs(tiny: Service) -> None:
    import httpx
    import threading

    before_tokens = tiny.metric("edge_completion_tokens_total")
    before_prompt = tiny.metric("edge_prompt_tokens_total")
    before_aborts = tiny.metric("edge_client_aborts_total")
    before_first = tiny.metric("edge_time_to_first_token_seconds_count")
    long = {}

    def occupy() -> None:  # keeps the worker busy while the second request waits in the queue: four
        # choices of 500 tokens, so that on a loaded machine it is still generating when the server
        # reads the second request and its close (one choice was done first, now and then)
        long["r"] = httpx.post(tiny.base + "/completions", timeout=120,
                               json={"prompt": "Hello", "max_tokens": 500, "temperature": 0, "n": 4})
    t = threading.Thread(target=occupy)
    t.start()
    for _ in range(400):  # bounded polling: the long request is generating, so it holds the worker
        # (queue depth alone is not enough: tokenizing counts in it too, before generation starts)
        if tiny.metric("edge_time_to_first_token_seconds_count") > before_first:
            break
        threading.Event().wait(0.01)
    body = json.dumps({"prompt": "Hello", "max_tokens": 500}).encode()
    with socket.create_connection(tiny.pid1.address) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    t.join()
    assert long["r"].status_code == 200
    for _ in range(200):  # bounded polling of the real counter
        if tiny.metric("edge_client_aborts_total") > before_aborts:
            break
        threading.Event().wait(0.05)
    assert tiny.metric("edge_client_aborts_total") == before_aborts + 1
    # the abandoned request never generated: only the long one's tokens were counted
    done = long["r"].json()["usage"]["completion_tokens"]
    assert tiny.metric("edge_completion_tokens_total") - before_tokens == done
    # ... and only its prompt: the abandoned one was never prefilled
    assert tiny.metric("edge_prompt_tokens_total") - before_prompt == long["r"].json()["usage"]["prompt_tokens"]
    assert "INFO status 499 (client closed request): completion for model 'tiny', the client left " \
           "before its answer" in tiny.pid1.log_tail(100_000)



def test_a_forced_calls_schema_keeps_each_tools_refs_pointing_into_its_parameters() -> None:
    from edge.serve.schema import schema_grammar
    from edge.serve.toolcall import call_schema

    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/a~1b"}}, "required": ["p"],
              "$defs": {"a/b": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("f", "g")]
    for some in (tools[:1], tools):
        gbnf = schema_grammar(call_schema(some), "tools")  # before: '#/$defs/a~1b' points to nothing
        assert "j-int" in gbnf.split("\nj-ws ::=")[0]


def test_a_forced_calls_refusal_names_the_tools_own_path() -> None:
    """The call's schema is converted once (off the event loop, in the app); a keyword edge refuses
    is named where the client wrote it: the tool's place in `tools`, the path in its parameters,
    a `$ref`'s pointer as the client wrote it."""
    from edge.serve.openai import Limits, parse
    from edge.serve.schema import schema_grammar

    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "number", "maximum": 3}}}}}
    limits = Limits(n_ctx=512, n_vocab=100, max_n=4, tools=True)
    for tools, choice in (([good, bad], "required"), ([good, bad], {"type": "function", "function": {"name": "g"}}),
                          ([bad], "required")):
        ask = parse({"messages": HI, "tools": tools, "tool_choice": choice}, True, limits)
        with pytest.raises(Exception) as err:
            schema_grammar(ask.schema.schema, ask.schema.param, ask.schema.place)
        i = tools.index(bad)
        assert err.value.param == "tools" and str(err.value).startswith(
            f"tools[{i}].function.parameters.properties.p.$ref(#/$defs/x).maximum: "), str(err.value)


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"tools": [CITY_TOOL], "tool_choice": "required"}])
def test_stop_beside_a_grammar_is_a_400_naming_stop(fmt: dict) -> None:
    from edge.errors import RequestError
    from edge.serve.openai import Limits, parse

    with pytest.raises(RequestError) as err:
        parse({"messages": HI, "stop": ["}"], **fmt}, True, Limits(n_ctx=512, n_vocab=100, max_n=4, tools=True))
    assert err.value.param == "stop" and "would" not in str(err.value) and "cut it inside a string" in str(err.value)


def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call(tools: Service) -> None:
    """max_tokens ends the call's JSON early: the answer is the call as far as it got (finish_reason
    `length`, the arguments' text so far), never prose without `tool_calls`, streamed or not."""
    partial = []
    for max_tokens in (1, 5, 40, 44):
        kw = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": [CITY_TOOL],
              "tool_choice": "required", "max_tokens": max_tokens, "temperature": 0}
        choice = tools.client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        args = call.function.arguments.replace(" ", "")  # the arguments so far: the start of a valid one
        assert call.function.name == "weather" and any(a.startswith(args) for a in ('{"city":"Paris"}', '{"city":"Oslo"}'))
        partial.append(args)
        streamed = list(tools.client.chat.completions.create(**kw, stream=True))
        calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert calls and calls[0].function.name == "weather" and streamed[-1].choices[0].finish_reason == "length"
    assert partial[0] == "" and partial[-1].startswith('{"'), partial  # cut in the name, then in the arguments
