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
from kit.chats import chats_in_turns
from kit.replay import left_by

pytestmark = pytest.mark.gemma

RULES = ("You are the support assistant of a small bakery. Opening hours are 7 to 19 on weekdays "
         "and 8 to 14 on Saturdays. Bread is baked twice a day. ") * 12  # ~400 tokens
QUESTION = "\nQuestion: When does the bakery open on Saturday?\nAnswer:"


def load(path: Path, **fields: object) -> GGUFModel:
    """One slot: the whole states these checkpoints are made of need a one-sequence context
    (docs/internals.md "Serving many clients", "Prompt cache per slot")."""
    cfg = ModelConfig(**{"name": "gemma", "path": str(path), "n_ctx": 1024, "n_threads": 2,  # type: ignore[arg-type]
                         "use_mlock": False, "parallel": 1, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


def greedy(m: GGUFModel, prompt: list[int], **job: object) -> tuple[str, list[float], int]:
    j = Job(tokens=prompt, params=GenParams(max_tokens=12, temperature=0, logprobs=1), **job)  # type: ignore[arg-type]
    pieces = list(m.generate(j))
    return "".join(p.text for p in pieces), [lp.logprob for p in pieces for lp in p.logprobs], j.cached_tokens


def test_a_restored_state_answers_as_the_computed_one(gemma_path: Path, tmp_path: Path) -> None:
    """A declared prefix's state restored from disk answers bit for bit as when it was computed,
    and as the prefix computed fresh by the test (kit.replay.left_by). A prefill of the whole
    prompt from position 0 (cache_prompt false) is another computation (other batches, the KV
    cells in another order): how far its answer lies is llama.cpp's on this CPU, not edge's
    (docs/api.md "Reproducibility"), so it is not compared."""
    prefixes = [PrefixConfig(name="rules", text=RULES)]
    first = load(gemma_path, prefixes=prefixes)
    try:
        (row,) = restore_prefixes(first, tmp_path, "edge.toml", "models[0]")
        assert row["outcome"] == "computed" and row["tokens"] > 300
        prompt = first.tokenize_prompt(RULES + QUESTION)
        computed = greedy(first, prompt)
        recomputed = greedy(first, prompt, cache_prompt=False)  # the whole prompt, from position 0
        left_by(first, prefix_tokens(first, prefixes[0]))
        replayed = greedy(first, prompt)
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
    assert restored == computed == replayed  # the same state: the same output, bit for bit


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
    reuse it after a short one. One slot (load): with several, llama.cpp sizes the window cache
    for all of them (here the whole context), and nothing is evicted."""
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


# -- sliding-window checkpoints (swa_full = false, the default): prefixes that take turns ------------
WORDS = ("apple river stone cloud forest garden window bridge candle market silver orange basket "
         "mirror pencil rabbit engine harbor island ladder").split()


def words(seed: int, n: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def gemma2k(gemma_path: Path) -> GGUFModel:
    from edge.builtin_models import GEMMA_TEMPLATE  # what builtin:gemma3-270m serves with

    m = load(gemma_path, n_ctx=2048, chat_template=GEMMA_TEMPLATE)
    assert m.native.n_swa == 512 and not m.cache.entries
    yield m
    m.close()


def fresh_cache(m: GGUFModel, limit: int | None = None) -> None:
    m.cache.clear()
    m.slots.forget()
    m.cache.limit_bytes = limit or m.cache.limit_bytes


@pytest.mark.parametrize("n_prefixes", [2, 3])
def test_undeclared_prefixes_that_take_turns_are_reused_after_their_first_request(gemma2k: GGUFModel,
                                                                                  n_prefixes: int) -> None:
    """The issue's rotation: ~800-token prefixes, each with a novel 24-token question, in turns.
    Every repeat reuses the whole prefix (97 % of its prompt) for one restore, so one unrelated
    request costs the next user of a long prefix a restore, not a prefill."""
    m = gemma2k
    fresh_cache(m)
    prefixes = [m.tokenize_prompt(words(100 + i, 800))[:800] for i in range(n_prefixes)]
    seeds = iter(range(1000, 1100))
    for rnd in range(4):
        for p in prefixes:
            restores = m.cache.stats.restores
            prompt = p + m.tokenize_text(" " + words(next(seeds), 30))[:24]
            got = greedy(m, prompt)[2]
            if rnd:
                assert got >= 0.9 * len(prompt) and m.cache.stats.restores == restores + 1, (rnd, got)
            else:
                assert got <= 1
    assert m.cache.nbytes <= m.cache.limit_bytes


def test_two_chats_in_turns_reuse_all_but_their_new_turn(gemma2k: GGUFModel) -> None:
    """Two conversations (the built-in Gemma template) whose turns alternate, each re-sending its
    growing history: turn k reuses turn k - 1's prompt and the answer, and computes the new turn."""
    m = gemma2k
    fresh_cache(m)
    previous = chats_in_turns(m, [words(1, 300), words(2, 300)], lambda turn, c: words(10 * turn + c, 60),
                              max_tokens=24)
    assert min(previous) > 700


def test_checkpoints_are_evicted_by_bytes_least_recently_used_first(gemma2k: GGUFModel) -> None:
    m = gemma2k
    fresh_cache(m)
    prefixes = {k: m.tokenize_prompt(words(200 + i, 800))[:800] for i, k in enumerate("ABC")}
    seeds = iter(range(2000, 2100))

    def ask(k: str) -> int:
        got = greedy(m, prefixes[k] + m.tokenize_text(" " + words(next(seeds), 30))[:24])[2]
        assert m.cache.nbytes <= m.cache.limit_bytes
        return got

    ask("A")
    one = m.cache.nbytes
    fresh_cache(m, limit=2 * one + one // 2)  # two states of these prompts fit, not three
    reused = [ask(k) for k in "ABCBAB"]  # C evicts A, then A evicts C
    assert [r >= 800 for r in reused] == [False, False, False, True, False, True]
    assert m.cache.stats.evictions == 2 and len(m.cache.entries) == 2


def test_a_checkpointed_answer_is_the_state_its_request_left_bit_for_bit(gemma2k: GGUFModel) -> None:
    """docs/api.md "Reproducibility": a prefix from the cache answers exactly as the state the
    request that left it computed (kit.replay.left_by: that prompt computed fresh, restored and
    cut as the cache does), after an unrelated request between. A fresh prefill of the whole
    prompt is another computation: other batches (this model's Q4_K kernels round differently by
    batch on an AVX-512 build, not on an AVX2 one) and the KV cells in another order; the greedy
    text then parts at a near-tie on some CPUs ("Yes, bread is baked" / "Yes, it is baked").
    That is llama.cpp's, measured by `scripts/bench cache_bound`, and not asserted here."""
    m = gemma2k
    fresh_cache(m)
    prefix = m.tokenize_prompt(RULES * 2)[:800]
    first = prefix + m.tokenize_prompt(QUESTION)[1:]
    greedy(m, first)
    greedy(m, m.tokenize_prompt(words(5, 300)))  # an unrelated request between
    question = m.tokenize_prompt("\nQuestion: Is bread baked twice a day?\nAnswer:")[1:]
    text, lps, reused = greedy(m, prefix + question)
    assert reused >= 800
    left_by(m, first)
    assert greedy(m, prefix + question) == (text, lps, reused)  # exact floats
    assert greedy(m, prefix + question, cache_prompt=False)[2] == 0
