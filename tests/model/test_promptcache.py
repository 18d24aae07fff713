"""The prompt cache (edge.model.promptcache) on a real llama.cpp context: tiny GGUF models in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.promptcache import MIN_REUSE, lcp
from kit.replay import left_by

PREFIX = "Hello world. " * 8  # 140 tokens in the tiny vocabulary (bytes and a few words)


def load(path: Path, **fields: object) -> GGUFModel:
    """One slot: one live sequence and the saved states beside it (with more, a request lands on
    the slot whose sequence shares most of it: tests/model/test_prefix_turns.py)."""
    cfg = ModelConfig(name="tiny", path=str(path), n_ctx=512, n_batch=64, n_threads=1,  # type: ignore[arg-type]
                      use_mlock=False, **{"parallel": 1, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


@pytest.fixture()
def model(tiny_gguf: Path) -> GGUFModel:
    m = load(tiny_gguf)
    yield m
    m.close()


def run(m: GGUFModel, text: str, max_tokens: int = 6, **job: object) -> tuple[Job, str, list[float]]:
    j = Job(tokens=m.tokenize_prompt(text), params=GenParams(max_tokens=max_tokens, temperature=0, logprobs=2),
            **job)  # type: ignore[arg-type]
    pieces = list(m.generate(j))
    return j, "".join(p.text for p in pieces), [lp.logprob for p in pieces for lp in p.logprobs]


def run_tokens(m: GGUFModel, tokens: list[int]) -> Job:
    j = Job(tokens=tokens, params=GenParams(max_tokens=4, temperature=0))
    list(m.generate(j))
    return j


def test_lcp() -> None:
    assert lcp([], [1]) == 0
    assert lcp([1, 2, 3], [1, 2, 3, 4]) == 3
    assert lcp([1, 2, 3], [1, 9, 3]) == 1
    assert lcp([5], [6]) == 0
    assert lcp(list(range(1000)), list(range(999)) + [7]) == 999


def test_the_next_request_reuses_the_live_prefix(model: GGUFModel) -> None:
    first, _, _ = run(model, PREFIX + "the a")
    assert first.cached_tokens <= 1  # nothing before it but (maybe) a BOS
    nxt, _, _ = run(model, PREFIX + "the e")
    assert nxt.cached_tokens >= len(model.tokenize_prompt(PREFIX)) - 1
    assert model.cache.stats.hits == 1 and model.cache.stats.misses == 1


def test_reused_tokens_are_what_each_generation_reused_short_reuse_included(model: GGUFModel) -> None:
    jobs = [run(model, text)[0] for text in (PREFIX + "the a", "the a b", "the a c", PREFIX + "the e")]
    assert 0 < jobs[2].cached_tokens < 16  # a short reuse (BOS and a word): a miss, still reused
    assert model.cache.stats.reused_tokens == sum(j.cached_tokens for j in jobs)
    assert (model.cache.stats.hits, model.cache.stats.misses) == (1, 3)


def test_an_unrelated_request_does_not_lose_a_long_prefix(model: GGUFModel) -> None:
    run(model, PREFIX + "the a")
    unrelated, _, _ = run(model, "a the a the " * 8)
    assert unrelated.cached_tokens < MIN_REUSE
    assert model.cache.stats.saves == 1 and model.cache.nbytes > 0  # the prefix's state, saved
    again, text, lps = run(model, PREFIX + "the e")
    assert again.cached_tokens >= len(model.tokenize_prompt(PREFIX)) - 1
    assert model.cache.stats.restores == 1
    # the restored prefix answers as the state the first request left, computed fresh by the test
    # (kit.replay: a prefill of the whole prompt is another computation, llama.cpp's to round)
    left_by(model, model.tokenize_prompt(PREFIX + "the a"))
    replayed, replayed_text, replayed_lps = run(model, PREFIX + "the e")
    assert replayed.cached_tokens == again.cached_tokens and (replayed_text, replayed_lps) == (text, lps)


def test_cache_prompt_false_repeats_bit_for_bit_whatever_ran_before(model: GGUFModel) -> None:
    _, a1, lps1 = run(model, "the world the " * 6, cache_prompt=False)
    run(model, "e t o n " * 10)
    _, a2, lps2 = run(model, "the world the " * 6, cache_prompt=False)
    _, _, lps3 = run(model, "the world the " * 6, cache_prompt=False)  # right after itself
    assert a1 == a2 and lps1 == lps2 == lps3  # exact floats, not approximately


def test_memory_held_never_exceeds_the_bound_and_the_oldest_goes_first(tiny_gguf: Path) -> None:
    m = load(tiny_gguf)
    try:
        prompts = [[1] + [tok] * 120 for tok in range(260, 265)]  # same length, no common prefix
        done = [run_tokens(m, prompts[0]), run_tokens(m, prompts[1])]  # saves prompts[0]'s state
        size = m.cache.nbytes
        m.cache.limit_bytes = 2 * size + size // 2  # room for two states, not three
        for p in prompts[2:]:
            done.append(run_tokens(m, p))
            assert m.cache.nbytes <= m.cache.limit_bytes
        # prompts[4] is live; of the states saved before it, the two most recent are kept
        assert [e.tokens[:121] for e in m.cache.entries.values()] == prompts[2:4]
        assert m.cache.stats.evictions == 2 and m.cache.stats.saves == 4
        assert all(j.cached_tokens <= 1 for j in done)
    finally:
        m.close()


def test_a_pinned_state_is_never_evicted(tiny_gguf: Path) -> None:
    from edge.model.promptcache import Entry

    m = load(tiny_gguf)
    try:
        m.cache.prefill(0, m.tokenize_prompt(PREFIX))
        pinned = Entry(m.tokenize_prompt(PREFIX), m.native.state_bytes(0), name="sys", pinned=True)
        m.cache.limit_bytes = 2 * pinned.nbytes
        assert m.cache.add(pinned)
        for w in ("the", "a", "world", "Hello"):
            run(m, f"{w} " * 60)
        assert pinned in m.cache.pinned()
        assert m.cache.nbytes <= m.cache.limit_bytes
        again, _, _ = run(m, PREFIX + "the")
        assert again.cached_tokens >= len(pinned.tokens) - 1
        assert not m.cache.add(Entry([1], b"x" * (m.cache.limit_bytes + 1)))  # cannot fit: refused
    finally:
        m.close()


def test_a_prompt_cache_of_zero_keeps_only_the_live_sequence(tiny_gguf: Path) -> None:
    m = load(tiny_gguf, prompt_cache_mb=0)
    try:
        run(m, PREFIX + "the a")
        run(m, "a the a the " * 8)
        again, _, _ = run(m, PREFIX + "the e")
        assert m.cache.nbytes == 0 and m.cache.stats.saves == 0
        assert again.cached_tokens < MIN_REUSE
    finally:
        m.close()


def test_a_failed_decode_empties_the_sequence(model: GGUFModel) -> None:
    from edge.model.native import DecodeError

    run(model, PREFIX)
    with pytest.raises(DecodeError):
        model.cache.prefill(0, model.tokenize_prompt("the " * 300) * 2)  # more than the context holds
    assert model.cache.live(0) == []
    after, _, _ = run(model, PREFIX)  # and the model still answers
    assert after.completion_tokens == 6


def test_warm_up_requests_leave_the_cache_as_they_found_it(model: GGUFModel) -> None:
    run(model, PREFIX + "the a")
    run(model, "a the a the " * 8, remember=False)
    assert model.cache.stats.saves == 0 and model.cache.stats.hits + model.cache.stats.misses == 1


def test_the_model_key_is_the_file_not_the_path(tmp_path: Path, tiny_gguf: Path) -> None:
    """OTA versions hard-link one model file under their own paths: still the same model."""
    import os

    from edge.lifecycle.loadset import model_key

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    os.link(tiny_gguf, a)
    os.link(tiny_gguf, b)
    c.write_bytes(tiny_gguf.read_bytes())  # the same bytes, another file: another model
    key = model_key(ModelConfig(name="m", path=str(a)))
    assert key == model_key(ModelConfig(name="m", path=str(b)))
    assert key != model_key(ModelConfig(name="m", path=str(c)))
    assert key != model_key(ModelConfig(name="m", path=str(b), n_ctx=1024))  # other settings


def test_making_room_never_evicts_the_state_about_to_be_restored(tiny_gguf: Path) -> None:
    """A full cache, an unrelated request, then the oldest prefix again: saving the unrelated
    request's state must not evict the very state the next request restores."""
    m = load(tiny_gguf)
    try:
        a, b, other = ([1] + [tok] * 120 for tok in (260, 261, 262))
        run_tokens(m, a)
        run_tokens(m, b)  # saves a
        size = m.cache.nbytes
        m.cache.limit_bytes = 2 * size + size // 2  # two states
        run_tokens(m, other)  # saves b: a and b held
        again = run_tokens(m, a + [263] * 5)  # saving `other` must evict b, not a
        assert again.cached_tokens == len(a)
        assert m.cache.nbytes <= m.cache.limit_bytes
    finally:
        m.close()


def test_a_state_that_cannot_be_cut_there_is_not_chosen_and_stays(tiny_gguf: Path) -> None:
    """A saved state whose window does not reach back to where a prompt leaves it is passed
    over (the prompt is computed) and kept for prompts that continue it whole."""
    m = load(tiny_gguf)
    try:
        long = [1] + [260] * 200
        run_tokens(m, long)
        run_tokens(m, [1] + [261] * 50)  # saves `long`
        (entry,) = m.cache.entries.values()
        entry.pos_min = 150  # as a state saved with only a 50-token sliding window's end
        m.native.n_swa = 50  # (the tiny model has none: its n_swa stands in for Gemma's here)
        cut = run_tokens(m, long[:60] + [262] * 3)
        assert cut.cached_tokens < 16 and entry in m.cache.entries.values()
        whole = run_tokens(m, long + [263] + [262] * 3)
        assert whole.cached_tokens >= len(long)
    finally:
        m.native.n_swa = 0
        m.close()
