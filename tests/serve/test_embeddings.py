"""`POST /v1/embeddings` in process, on a real (tiny) llama.cpp model with an embeddings context
on the same weights: OpenAI's shapes, its errors, batching across inputs and requests, and
vectors equal to the same inputs embedded alone by llama.cpp directly."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path

import httpx
import numpy as np
import pytest

from edge.config import EmbeddingsConfig, ModelConfig
from edge.model.gguf import read_gguf_info
from edge.model.llm import load_gguf_model
from edge.serve.app import ServiceState, build_app
from edge.serve.worker import ModelWorker

N_BATCH = 64


@pytest.fixture(scope="module")
def model(tiny_gguf: Path):
    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=128, n_threads=1,
                      embeddings=EmbeddingsConfig(n_batch=N_BATCH, dimensions=[16, 32]))
    m = load_gguf_model(cfg, read_gguf_info(tiny_gguf))
    yield m
    m.close()


def make_state(model, max_queue: int = 64) -> ServiceState:
    state = ServiceState(workers={"tiny": ModelWorker(model, max_queue)})
    state.ready = True
    return state


async def call(state: ServiceState, method: str, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        return await client.request(method, path, **kw)


def post(state: ServiceState, body: dict) -> httpx.Response:
    return asyncio.run(call(state, "POST", "/v1/embeddings", json=body))


def alone(model, tokens: list[int]) -> np.ndarray:
    """The reference: one input in a decode of its own, straight through llama.cpp, made unit."""
    v = model.embed.embed([tokens])[0]
    return v / np.linalg.norm(v)


def test_a_string_answers_in_openais_shape_with_a_unit_vector(model) -> None:
    r = post(make_state(model), {"model": "tiny", "input": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    vec = np.array(item["embedding"])
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    n = len(model.tokenize_prompt("Hello world"))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert np.allclose(vec, alone(model, model.tokenize_prompt("Hello world")), atol=1e-5)


def test_many_inputs_of_one_request_are_batched_and_each_equals_its_vector_alone(model) -> None:
    texts = [f"the {'world ' * (i % 3)}a{i}" for i in range(40)]
    before = model.embed.batches
    body = post(make_state(model), {"input": texts}).json()
    batches = model.embed.batches - before
    assert [d["index"] for d in body["data"]] == list(range(40))
    tokens = [model.tokenize_prompt(t) for t in texts]
    # packed in order: every batch but the last leaves less room than the next input needs
    assert batches <= -(-sum(map(len, tokens)) // (N_BATCH - max(map(len, tokens)))) + 1 < len(texts)
    for d, t in zip(body["data"], tokens):
        assert float(np.dot(d["embedding"], alone(model, t))) > 0.9999
    assert body["usage"]["prompt_tokens"] == sum(map(len, tokens))


def test_token_arrays_and_base64_and_matryoshka_dimensions(model) -> None:
    ids = model.tokenize_prompt("Hello")
    state = make_state(model)
    one = post(state, {"input": ids}).json()["data"]
    two = post(state, {"input": [ids, "Hello"], "encoding_format": "base64"}).json()["data"]
    assert len(one) == 1 and len(two) == 2
    decoded = np.frombuffer(base64.b64decode(two[0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, one[0]["embedding"], atol=1e-6)
    cut = post(state, {"input": ids, "dimensions": 16}).json()["data"][0]["embedding"]
    full = alone(model, ids)
    assert len(cut) == 16 and np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    assert len(post(state, {"input": ids, "dimensions": 64}).json()["data"][0]["embedding"]) == 64


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input[0]", "empty string"),
    ({"input": []}, "input", "empty array"),
    ({"input": ["ok", 3]}, "input[1]", "string or a non-empty array of token ids"),
    ({"input": ["ok", [1, 99999]]}, "input[1]", "outside this model's vocabulary"),
    ({"input": "x", "dimensions": 20}, "dimensions", "[16, 32, 64]"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "x", "temperature": 1}, "temperature", "unknown field"),
    ({"prompt": "x"}, "prompt", "unknown field"),
    ({"input": ["ok", "hello " * 80]}, "input[1]", "more than the 64 an embeddings batch holds"),
])
def test_a_bad_request_is_a_400_naming_the_field(model, body: dict, param: str, words: str) -> None:
    r = post(make_state(model), body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_a_model_without_embeddings_or_unknown_is_refused_by_name(model, tiny_gguf: Path) -> None:
    plain = load_gguf_model(ModelConfig(name="plain", path=str(tiny_gguf), n_ctx=64), read_gguf_info(tiny_gguf))
    try:
        state = ServiceState(workers={"tiny": ModelWorker(model, 8), "plain": ModelWorker(plain, 8)}, ready=True)
        r = post(state, {"model": "plain", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "[models.embeddings]" in r.json()["error"]["message"] and "['tiny']" in r.json()["error"]["message"]
        assert post(state, {"model": "nope", "input": "x"}).status_code == 404
        assert post(state, {"input": "x"}).status_code == 200  # no model named: the one with embeddings
    finally:
        plain.close()


def test_inputs_of_concurrent_requests_share_batches(model) -> None:
    """Requests that arrive while a batch decodes go into the next one together: fewer decodes
    than requests, and every answer still its inputs' own vectors."""
    state = make_state(model)
    texts = [f"a{i} the world" for i in range(24)]

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={"input": t}) for t in texts))

    before = model.embed.batches
    answers = asyncio.run(main())
    assert model.embed.batches - before < len(texts)
    for r, t in zip(answers, texts):
        assert float(np.dot(r.json()["data"][0]["embedding"], alone(model, model.tokenize_prompt(t)))) > 0.9999


def test_models_lists_the_embeddings_context_and_metrics_count_it(model) -> None:
    state = make_state(model)
    meta = asyncio.run(call(state, "GET", "/v1/models")).json()["data"][0]["meta"]
    assert meta["embeddings"]["pooling"] == "mean" and meta["embeddings"]["dimensions"] == 64
    assert meta["embeddings"]["n_batch"] == N_BATCH and meta["embeddings"]["matryoshka"] == [16, 32]
    post(state, {"input": ["a", "b", "c"]})
    text = asyncio.run(call(state, "GET", "/metrics")).text
    assert 'edge_requests_total{method="POST",route="/v1/embeddings",status="200"} 1.0' in text
    assert 'edge_embedding_inputs_total{model="tiny"} 3.0' in text
    assert 'edge_embedding_batches_total{model="tiny"} 1.0' in text


def test_pooling_comes_from_the_config_else_the_gguf_else_mean(model) -> None:
    from edge.model.embed import pooling_for

    info = dataclasses.replace(model.info, metadata={**model.info.metadata, "llama.pooling_type": 2})
    assert pooling_for(EmbeddingsConfig(), model.info) == ("mean", "default: the model declares none")
    assert pooling_for(EmbeddingsConfig(), info)[0] == "cls"
    assert pooling_for(EmbeddingsConfig(pooling="last"), info) == ("last", "configured")


def test_a_batch_takes_the_oldest_inputs_in_order_while_they_fit() -> None:
    from edge.model.embed import pack

    assert pack([10, 50, 20, 1], 64, 8) == 2
    assert pack([64, 1], 64, 8) == 1
    assert pack([1] * 10, 64, 4) == 4


def test_a_request_past_request_timeout_s_is_a_422_and_its_inputs_are_dropped(model) -> None:
    """The model thread is held by a call that waits for an event (a stand-in for a long batch
    ahead): the request's wait ends at request_timeout_s, and its inputs never reach a batch."""
    import threading

    worker = ModelWorker(model, 8, request_timeout_s=0.2)
    state = ServiceState(workers={"tiny": worker}, ready=True)
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(30)

    holder = threading.Thread(target=worker.run, args=(hold,))
    holder.start()
    started.wait(30)
    try:
        before = model.embed.inputs
        r = post(state, {"input": ["a", "b"]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "generation_timeout"
        assert "server.request_timeout_s = 0.2 s" in r.json()["error"]["message"]
    finally:
        gate.set()
        holder.join(30)
    assert post(state, {"input": "c"}).status_code == 200
    assert model.embed.inputs == before + 1  # a and b were dropped, not decoded later
