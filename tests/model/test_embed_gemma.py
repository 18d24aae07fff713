"""Embeddings from the embedded default model (Gemma 3 270M, `builtin:gemma3-270m`, mean pooling)
through a real `edge serve`, checked against llama.cpp's own embedding of the same texts by
llama-cpp-python's `Llama(embedding=True).embed` (each text alone, normalized)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kit import EDGE, PidOne, post

pytestmark = pytest.mark.gemma

TOPICS = ("the harbor at dawn", "a recipe for bread", "battery voltage telemetry", "the rules of chess",
          "a quiet mountain village", "how vaccines train the immune system", "the price of copper",
          "a rainy evening in the city")


def texts() -> list[str]:
    """64 inputs of 4 to 40 words: short ones, and some that fill a good part of a batch."""
    out = []
    for i in range(64):
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Note {i}: {topic}." + " It is described in some detail here" * (i % 6))
    return out


def test_64_inputs_match_llama_cpps_own_embeddings(gemma_path: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    os.link(gemma_path, cache / "models" / gemma_path.name) if gemma_path.stat().st_dev == tmp_path.stat().st_dev \
        else shutil.copy(gemma_path, cache / "models" / gemma_path.name)  # the builtin, installed in the cache
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "state"}"\ncache_dir = "{cache}"\n'
                   '[[models]]\nname = "gemma3-270m"\npath = "builtin:gemma3-270m"\nn_ctx = 512\nn_threads = 2\n'
                   '[models.embeddings]\npooling = "mean"\n')
    inputs = texts()
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        status, body = post(pid1.address, "/v1/embeddings", {"model": "gemma3-270m", "input": inputs}, timeout=600)
        assert pid1.stop() == 0
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(64))
    ours = np.array([d["embedding"] for d in body["data"]])
    assert ours.shape == (64, 640) and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)

    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama

    ref = Llama(model_path=str(gemma_path), embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN, n_ctx=512,
                n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    try:
        theirs = np.array(ref.embed(inputs, normalize=True))
        n_tokens = sum(len(ref.tokenize(t.encode(), add_bos=True, special=True)) for t in inputs)
    finally:
        ref.close()
    cosines = (ours * theirs).sum(axis=1)
    assert cosines.min() >= 0.9999, sorted(cosines)[:4]
    assert body["usage"]["prompt_tokens"] == n_tokens
    # related texts are nearer than unrelated ones: the vectors mean something
    assert float(ours[0] @ ours[8]) > float(ours[0] @ ours[3])


def test_the_memory_guard_counts_what_the_embeddings_context_takes(gemma_path: Path) -> None:
    """The embeddings context's need (edge.model.memory.embeddings_need) against what this
    process's resident memory grows by when the context is made and decodes a full batch: the
    compute and output buffers hold every token's logits (262,144 of them a token here)."""
    from edge.config import EmbeddingsConfig, ModelConfig
    from edge.model.embed import EmbedContext
    from edge.model.gguf import read_gguf_info
    from edge.model.llm import load_gguf_model
    from edge.model.memory import embeddings_need

    def rss() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    cfg = ModelConfig(name="g", path=str(gemma_path), n_ctx=256, n_threads=2, use_mlock=False,
                      embeddings=EmbeddingsConfig(n_batch=256))
    info = read_gguf_info(gemma_path)
    model = load_gguf_model(dataclasses.replace(cfg, embeddings=None), info)
    try:
        before = rss()
        ctx = EmbedContext(model.native, cfg.embeddings, info)  # type: ignore[arg-type]
        ctx.embed([list(range(1000, 1256))])
        grew = rss() - before
        ctx.close()
    finally:
        model.close()
    need = embeddings_need(cfg, info)
    assert 0.85 * need <= grew <= need, (grew / 2**20, need / 2**20)

