"""Prefix states on the real model (Gemma 3 270M, sliding-window attention): a state restored
from disk answers exactly as when it was computed, and as a prefix recomputed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import MessageConfig, ModelConfig, PrefixConfig
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.prefixstore import prefix_tokens, restore_prefixes

pytestmark = pytest.mark.gemma

RULES = ("You are the support assistant of a small bakery. Opening hours are 7 to 19 on weekdays "
         "and 8 to 14 on Saturdays. Bread is baked twice a day. ") * 12  # ~400 tokens
QUESTION = "\nQuestion: When does the bakery open on Saturday?\nAnswer:"


def load(path: Path, **fields: object) -> GGUFModel:
    cfg = ModelConfig(**{"name": "gemma", "path": str(path), "n_ctx": 1024, "n_threads": 2,  # type: ignore[arg-type]
                         "use_mlock": False, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


def greedy(m: GGUFModel, prompt: list[int], **job: object) -> tuple[str, list[float], int]:
    j = Job(tokens=prompt, params=GenParams(max_tokens=12, temperature=0, logprobs=1), **job)  # type: ignore[arg-type]
    pieces = list(m.generate(j))
    return "".join(p.text for p in pieces), [lp.logprob for p in pieces for lp in p.logprobs], j.cached_tokens


def test_a_restored_state_answers_as_the_computed_one(gemma_path: Path, tmp_path: Path) -> None:
    prefixes = [PrefixConfig(name="rules", text=RULES)]
    first = load(gemma_path, prefixes=prefixes)
    try:
        (row,) = restore_prefixes(first, tmp_path, "edge.toml", "models[0]")
        assert row["outcome"] == "computed" and row["tokens"] > 300
        prompt = first.tokenize_prompt(RULES + QUESTION)
        computed = greedy(first, prompt)
        recomputed = greedy(first, prompt, cache_prompt=False)  # the whole prompt, from position 0
    finally:
        first.close()
    second = load(gemma_path, prefixes=prefixes)
    try:
        (row,) = restore_prefixes(second, tmp_path, "edge.toml", "models[0]")
        assert row["outcome"] == "restored"
        restored = greedy(second, prompt)
    finally:
        second.close()
    assert restored[2] >= row["tokens"] - 1 and computed[2] >= row["tokens"] - 1 and recomputed[2] == 0
    assert restored[:2] == computed[:2]  # the same state bytes: the same output, bit for bit
    # a prefix computed alone and then extended vs the whole prompt at once: llama.cpp's batches
    # differ (other kernels and activation quantization per batch), so logprobs differ by up to
    # ~0.1 on this Q4 model (README "Reproducibility"); the greedy tokens are the same
    assert restored[0] == recomputed[0]


def test_a_chat_prefix_on_the_builtin_gemma_template(gemma_path: Path, tmp_path: Path) -> None:
    system = [MessageConfig(role="system", content="You are a terse assistant. Answer in one word.")]
    from edge.builtin_models import GEMMA_TEMPLATE  # what builtin:gemma3-270m serves with

    m = load(gemma_path, chat_template=GEMMA_TEMPLATE, prefixes=[PrefixConfig(name="terse", messages=system)])
    try:
        restore_prefixes(m, tmp_path, "edge.toml", "models[0]")
        prefix = prefix_tokens(m, m.cfg.prefixes[0])
        for q in ("What color is the sky?", "Name a fruit."):
            tokens, _ = m.tokenize_chat([{"role": "system", "content": system[0].content},
                                         {"role": "user", "content": q}])
            _, _, reused = greedy(m, tokens)
            assert reused >= len(prefix) - 2, (reused, len(prefix))
    finally:
        m.close()


def test_a_prefix_whose_sliding_window_was_evicted_is_computed_again(gemma_path: Path) -> None:
    """swa_full = false (the default, as llama-server): Gemma 3's sliding-window layers keep only
    their window. After a long continuation the window behind the prefix's end is gone: the cache
    must not reuse the prefix then (the answer would be computed from missing KV), and must
    reuse it after a short one."""
    m = load(gemma_path, n_ctx=2048)
    try:
        assert m.native.n_swa == 512
        prefix = m.tokenize_prompt(RULES * 2)[:600]
        question = m.tokenize_prompt(QUESTION)[1:]
        greedy(m, prefix + m.tokenize_prompt(RULES * 3)[1:1200])  # 1,200 more tokens: window moved on
        after_long = greedy(m, prefix + question)
        assert after_long[2] == 0  # not reused: the window before position 600 was evicted
        after_short = greedy(m, prefix + question[:-3])  # a short continuation: reused
        assert after_short[2] >= 600 - 1
        fresh = greedy(m, prefix + question, cache_prompt=False)
        assert after_long[:2] == fresh[:2]
    finally:
        m.close()
