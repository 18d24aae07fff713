"""Prompt cache checkpoints for sliding-window models (edge.model.checkpoints, edge.model.promptcache)
on a real llama.cpp context: a tiny Gemma 3 whose sliding-window layers see 32 tokens, with
`swa_full = false` (llama.cpp then keeps each window and a batch: 256 cells here), one slot (whole
states: Native.whole_states)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.config import ModelConfig
from edge.model.checkpoints import MIN_NEW
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from kit.chats import chats_in_turns
from kit.replay import left_by

N_SWA = 32


def load(path: Path, **fields: object) -> GGUFModel:
    cfg = ModelConfig(**{"name": "tiny", "path": str(path), "n_ctx": 1024, "n_batch": 64, "n_threads": 1, "parallel": 1,  # type: ignore[arg-type]
                         "use_mlock": False, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


@pytest.fixture()
def model(tiny_swa_gguf: Path) -> GGUFModel:
    m = load(tiny_swa_gguf)
    assert m.native.n_swa == N_SWA
    yield m
    m.close()


def tokens(seed: int, n: int) -> list[int]:
    """BOS and n - 1 random tokens of the tiny vocabulary; the first differs for every seed."""
    rng = np.random.default_rng(seed)
    return [1, 3 + seed % 260] + [int(t) for t in rng.integers(3, 268, n - 2)]


def run(m: GGUFModel, prompt: list[int], max_tokens: int = 4, **job: object) -> tuple[Job, list[float]]:
    j = Job(tokens=prompt, params=GenParams(max_tokens=max_tokens, temperature=0, logprobs=1), **job)  # type: ignore[arg-type]
    pieces = list(m.generate(j))
    return j, [lp.logprob for p in pieces for lp in p.logprobs]


def test_the_window_edge_reaches_is_the_one_llama_cpp_masks_by(model: GGUFModel) -> None:
    """A windowed state holds its last n_swa positions. Cut one token back it still holds all
    that the re-decoded token sees: the same logits, bit for bit, as the state saved right before
    that token (nothing cut). Two back it lacks one key: other logits, further from them than a
    restore alone moves logits from a fresh prefill's (the KV cells come back in another order;
    how far is the CPU's, measured here: kit.replay). Native.reaches says so for both."""
    n, prompt = model.native, tokens(1, 260)

    def logits_after(saved_to: int, cut: int) -> tuple[bool, np.ndarray]:
        n.clear(0)
        n.decode(0, prompt[:saved_to], 0)
        assert n.set_state(0, n.state_bytes(0))  # windowed: what the last position sees
        reaches = n.reaches(n.pos_min(0), cut)
        assert n.keep(0, cut)
        n.decode(0, prompt[cut:cut + 1], cut)
        return reaches, n.logits().copy()

    n.clear(0)
    n.decode(0, prompt[:200], 0)
    fresh = n.logits().copy()
    whole, saved = logits_after(199, 199)  # saved right before token 199: nothing to cut
    reaches, exact = logits_after(200, 199)
    assert whole and reaches and np.array_equal(exact, saved)
    reaches, short = logits_after(201, 199)
    assert not reaches and np.abs(short - saved).max() > np.abs(saved - fresh).max()


@pytest.mark.parametrize("n_prefixes", [2, 3])
@pytest.mark.parametrize("prefix_len", [200, 400])  # within llama.cpp's window cache, and past it
def test_prefixes_that_take_turns_are_reused_after_their_first_request(tiny_swa_gguf: Path, n_prefixes: int,
                                                                       prefix_len: int) -> None:
    m = load(tiny_swa_gguf)
    try:
        prefixes = [tokens(seed, prefix_len) for seed in range(n_prefixes)]
        seeds = iter(range(100, 200))
        for rnd in range(3):
            for p in prefixes:
                job, _ = run(m, p + tokens(next(seeds), 10)[2:])
                if rnd:  # every repeat reuses the whole prefix (97 % of its prompt)
                    assert job.cached_tokens >= prefix_len, (rnd, job.cached_tokens)
                else:
                    assert job.cached_tokens <= 1
        assert m.cache.stats.hits == 2 * n_prefixes and m.cache.stats.restores == 2 * n_prefixes
        assert all(e.whole for e in m.cache.entries.values())
    finally:
        m.close()


def test_copies_leave_the_batches_and_so_the_answer_bit_for_bit_as_they_were(model: GGUFModel) -> None:
    """A prefill that takes checkpoints computes the same batches as one that takes none: the
    answers are the same floats."""
    prompt = tokens(7, 300)  # five batches of 64 and one of 44
    with_copies, lps = run(model, prompt, marks=[100, 250])
    taken = sorted(len(e.tokens) for e in model.cache.entries.values())
    assert taken and set(taken) <= {128, 256, 300} and 300 in taken
    model.cache.clear()
    without, fresh_lps = run(model, prompt, cache_prompt=False)
    assert with_copies.cached_tokens == without.cached_tokens == 0
    assert lps == fresh_lps  # exact floats


def test_a_checkpointed_answer_is_the_state_its_request_left_bit_for_bit(model: GGUFModel) -> None:
    """After an unrelated request, the checkpoint the first request left answers the second: the
    same floats as that first prompt's state computed fresh, restored and cut where the two part
    (kit.replay.left_by). Against a fresh prefill of the second prompt (cache_prompt false) it
    differs only by the restore's order of the KV cells: llama.cpp's, by an amount the CPU's
    kernels decide (docs/api.md "Reproducibility"), so no bound of it is asserted here."""
    prefix = tokens(3, 300)
    first, second = prefix + tokens(20, 12)[2:], prefix + tokens(22, 12)[2:]
    run(model, first)
    run(model, tokens(21, 150))  # unrelated
    again, lps = run(model, second)
    assert again.cached_tokens == 300
    left_by(model, first)
    replayed, replayed_lps = run(model, second)
    assert replayed.cached_tokens == 300 and replayed_lps == lps  # exact floats
    fresh, _ = run(model, second, cache_prompt=False)
    assert fresh.cached_tokens == 0


def test_a_short_prefill_after_a_hit_copies_nothing(model: GGUFModel) -> None:
    prefix = tokens(4, 300)
    run(model, prefix + tokens(30, 10)[2:])
    saves = model.cache.stats.saves
    hit, _ = run(model, prefix + tokens(31, 10)[2:])
    assert hit.cached_tokens >= 300 and len(hit.tokens) - hit.cached_tokens < MIN_NEW
    assert model.cache.stats.saves == saves


def test_memory_stays_within_the_bound_and_room_is_made_before_each_copy(tiny_swa_gguf: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.model.promptcache import Entry

    m = load(tiny_swa_gguf)
    try:
        m.cache.prefill(0, tokens(50, 80))
        pinned = Entry(tokens(50, 80), m.native.state_bytes(0), name="sys", pinned=True, pos_min=m.native.window_min(0))
        run(m, tokens(51, 300))
        one = max(e.nbytes for e in m.cache.entries.values())
        m.cache.clear()
        m.cache.limit_bytes = pinned.nbytes + 2 * one + one // 2  # the pinned state and two more
        assert m.cache.add(pinned)
        copies: list[int] = []
        native_copy = type(m.native).state_bytes

        def watched(self: object, seq: int, whole: bool = False) -> bytearray:
            state = native_copy(m.native, seq, whole)
            copies.append(m.cache.nbytes + len(state))  # the cache's bytes and the copy being made
            return state

        monkeypatch.setattr(type(m.native), "state_bytes", watched)
        prefixes = [tokens(seed, 300) for seed in range(52, 56)]  # four take turns; two fit
        for p in prefixes * 2:
            run(m, p + tokens(60, 10)[2:])
            assert m.cache.nbytes <= m.cache.limit_bytes
        assert copies and max(copies) <= m.cache.limit_bytes
        assert pinned in m.cache.pinned() and m.cache.stats.evictions >= 4
        # the two most recent prefixes are the ones kept (least recently used out first)
        kept = {tuple(e.tokens[:300]) for e in m.cache.entries.values() if not e.pinned}
        assert kept == {tuple(p) for p in prefixes[2:]}
    finally:
        m.close()


def test_a_long_prompt_keeps_its_system_turn_for_other_conversations(model: GGUFModel) -> None:
    """Past llama.cpp's window cache the end's state no longer reaches back to an early mark:
    the state after the batch that reached it is kept as well, once."""
    system = tokens(8, 90)
    first, _ = run(model, system + tokens(40, 400)[2:], marks=[90])
    ends = sorted(len(e.tokens) for e in model.cache.entries.values())
    assert ends == [128, 488]  # after the batch that reached position 90, and the end
    other, _ = run(model, system + tokens(41, 30)[2:])
    assert other.cached_tokens >= 90


def words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(str(w) for w in rng.choice(["the", "a", "Hello", "world", "tea", "note"], n))


def test_two_conversations_in_turns_reuse_all_but_their_new_turn(model: GGUFModel) -> None:
    """Two chats whose turns alternate, each re-sending its growing history: every turn reuses
    its previous prompt and more (the answer, as far as it renders to the same tokens), well past
    llama.cpp's window cache."""
    previous = chats_in_turns(model, [words(1, 40), words(2, 40)], lambda turn, c: words(10 * turn + c, 12))
    assert min(previous) > 256  # the histories outgrew the window cache
    assert model.cache.stats.hits == 10


def test_turn_marks_are_where_a_user_turn_begins(model: GGUFModel) -> None:
    msgs = [{"role": "system", "content": "the a"}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "world"}, {"role": "user", "content": "tea"}]
    prompt, _ = model.tokenize_chat(msgs)
    first, last = model.turn_marks(msgs, None, prompt)
    text = model.native.detokenize(prompt).decode()
    assert model.native.detokenize(prompt[:first]).decode() == text[:text.index("Hello")]
    assert model.native.detokenize(prompt[:last]).decode() == text[:text.index("tea")]
    assert model.turn_marks(msgs[:2], None, model.tokenize_chat(msgs[:2])[0]) == [first]
    assert model.turn_marks([{"role": "user", "content": "tea"}], None, prompt) == []
