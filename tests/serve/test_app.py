"""The HTTP API in process, on a real (tiny) llama.cpp model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from edge.serve.app import ServiceState, build_app
from edge.config import ModelConfig
from edge.model.gguf import read_gguf_info
from edge.model.llm import load_gguf_model
from edge.serve.worker import ModelWorker


@pytest.fixture(scope="module")
def model(tiny_gguf: Path):
    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=128, max_tokens_default=8)
    return load_gguf_model(cfg, read_gguf_info(tiny_gguf))


def make_state(model, max_queue: int = 64) -> ServiceState:
    state = ServiceState(workers={"tiny": ModelWorker(model, max_queue)})
    state.ready = True
    return state


def run(coro):
    return asyncio.run(coro)


async def call(state: ServiceState, method: str, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        return await client.request(method, path, **kw)


def test_completion_returns_openai_shape_and_usage(model) -> None:
    r = run(call(make_state(model), "POST", "/v1/completions",
                 json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_greedy_generation_is_deterministic(model) -> None:
    req = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
    a = run(call(make_state(model), "POST", "/v1/completions", json=req)).json()
    b = run(call(make_state(model), "POST", "/v1/completions", json=req)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_streaming_sends_sse_chunks_then_done(model) -> None:
    r = run(call(make_state(model), "POST", "/v1/chat/completions",
                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                       "stream": True, "temperature": 0}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e[len("data: "):] for e in r.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])  # said once, as OpenAI does
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_models_health_ready_and_metrics(model) -> None:
    state = make_state(model)
    assert run(call(state, "GET", "/v1/models")).json()["data"][0]["id"] == "tiny"
    assert run(call(state, "GET", "/healthz")).status_code == 200
    assert run(call(state, "GET", "/readyz")).status_code == 200
    run(call(state, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}))
    text = run(call(state, "GET", "/metrics")).text
    assert 'edge_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert "edge_ready 1.0" in text
    state.ready = False
    r = run(call(state, "GET", "/readyz"))
    assert r.status_code == 503 and r.json()["status"] == "starting"
    state.ready, state.stopping = True, True
    assert run(call(state, "GET", "/readyz")).json()["status"] == "stopping"


@pytest.mark.parametrize("path, kw, status, words", [
    ("/v1/completions", {"content": b"{not json"}, 400, "not valid JSON"),
    ("/v1/completions", {"content": b"[1, 2]"}, 400, "must be a JSON object"),
    # parsed by the app itself too (here without the limits layer): never a RecursionError
    ("/v1/completions", {"content": b"[" * 100_000 + b"]" * 100_000}, 400, "more than 64 levels deep"),
    ("/v1/chat/completions", {"content": b'{"a":' * 10_000 + b"1" + b"}" * 10_000}, 400,
     "more than 64 levels deep"),
    ("/v1/completions", {"json": {"prompt": "x", "model": "gpt-4"}}, 404, "not served here"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": -3}}, 400, "max_tokens must be in"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 10**9}}, 400, "max_tokens must be in"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": "5"}}, 400, "max_tokens must be int"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": True}}, 400, "max_tokens must be int"),
    ("/v1/completions", {"json": {"prompt": 5}}, 400, "prompt must be a string"),
    ("/v1/completions", {"json": {"prompt": "x", "n": 9}}, 400, "n must be in"),
    ("/v1/completions", {"json": {"prompt": "x", "temperature": 9}}, 400, "temperature"),
    ("/v1/completions", {"json": {"prompt": "x", "stop": [1]}}, 400, "stop must be"),
    ("/v1/completions", {"json": {"prompt": "word " * 400, "max_tokens": 4}}, 400, "more than the context"),
    ("/v1/completions", {"json": {"prompt": "x " * 30, "max_tokens": 100}}, 400, "more than the context"),
    ("/v1/chat/completions", {"json": {"messages": []}}, 400, "non-empty list"),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user"}]}}, 400, "messages[0]"),
])
def test_bad_requests_get_json_errors_and_service_keeps_serving(model, path, kw, status, words) -> None:
    state = make_state(model)
    r = run(call(state, "POST", path, **kw))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"]
    if "context" in words:  # names the real context size llama.cpp allocated
        assert f"context of {model.n_ctx} tokens" in err["message"]
        assert err["code"] == "context_length_exceeded"
    ok = run(call(state, "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}))
    assert ok.status_code == 200


def test_concurrent_clients_are_serialized_safely(model) -> None:
    state = make_state(model)

    async def many() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            reqs = [client.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 4,
                                                          "temperature": 0, "stream": i % 2 == 0})
                    for i in range(16)]
            return await asyncio.gather(*reqs)

    responses = run(many())
    assert [r.status_code for r in responses] == [200] * 16
    solo = run(call(state, "POST", "/v1/completions",
                    json={"prompt": "Hello 1", "max_tokens": 4, "temperature": 0}))
    assert responses[1].json()["choices"][0]["text"] == solo.json()["choices"][0]["text"]


def test_a_full_queue_answers_503_with_retry_after(model) -> None:
    state = make_state(model, max_queue=1)

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await asyncio.gather(*[client.post("/v1/completions", json={"prompt": "Hello",
                                                                               "max_tokens": 8})
                                          for _ in range(6)])

    codes = sorted(r.status_code for r in run(burst()))
    assert 200 in codes and 503 in codes
    busy = next(r for r in run(burst()) if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "max_queue" in busy.json()["error"]["message"]


def test_without_max_tokens_a_long_prompt_gets_what_the_context_has_left(model) -> None:
    state = make_state(model)
    prompt = "x"
    while len(model.tokenize_prompt(prompt + "x")) <= model.n_ctx - 3:
        prompt += "x"
    n_prompt = len(model.tokenize_prompt(prompt))
    assert n_prompt + model.cfg.max_tokens_default > model.n_ctx  # the default alone would not fit
    r = run(call(state, "POST", "/v1/completions", json={"prompt": prompt, "temperature": 0}))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == n_prompt and usage["total_tokens"] <= model.n_ctx
    explicit = run(call(state, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 8}))
    assert explicit.status_code == 400  # an explicit limit that does not fit stays an error


def test_a_full_queue_refuses_streams_before_the_first_byte_and_frees_every_place(model) -> None:
    state = make_state(model, max_queue=1)

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await asyncio.gather(*[client.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 8, "stream": True}) for _ in range(6)])

    responses = run(burst())
    busy = [r for r in responses if r.status_code == 503]
    assert busy and all(r.headers["retry-after"] == "1" and "data:" not in r.text for r in busy)
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses if r.status_code == 200)
    assert state.workers["tiny"].pending == 0  # every admitted stream gave its place back


class FailingDecodeDouble:
    """Test double at the llama.cpp boundary (edge.model.native.Native): delegates everything
    (what is set on it is set on the real one); the n-th batch decode raises what a broken
    native call would (not an edge error)."""

    def __init__(self, native, fail_at: int) -> None:
        object.__setattr__(self, "_native", native)
        object.__setattr__(self, "_left", fail_at)

    def __getattr__(self, name: str):
        return getattr(self._native, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._native, name, value)

    def decode_batch(self, *batch) -> None:
        object.__setattr__(self, "_left", self._left - 1)
        if self._left == 0:
            raise RuntimeError("a native call failed")
        self._native.decode_batch(*batch)


def test_an_unexpected_error_mid_stream_ends_the_stream_in_band(model) -> None:
    model.slots.forget()  # no slot holds cells of an earlier test's
    real = model.native
    model.native = model.cache.native = model.slots.native = FailingDecodeDouble(real, fail_at=3)
    try:
        resp = run(call(make_state(model), "POST", "/v1/completions",
                        json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}))
    finally:
        model.native = model.cache.native = model.slots.native = real
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert resp.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "internal error: RuntimeError"
    assert not any(model.cache.lives.values())  # the sequence's content was unknown: emptied
