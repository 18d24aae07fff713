"""Speculative decoding from the context (edge.model.speculate inside edge.model.slots) on real
tiny llama.cpp contexts: the text is the same with and without proposals (greedy, and seeded
draws), a token drawn at a proposal's row follows the target's distribution (the rejection rule,
checked statistically), proposals stop where they fail and never outrun max_tokens, and the
cells of rejected proposals are gone from the sequence."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edge.config import ModelConfig, parse_config
from edge.errors import ConfigError
from edge.model.generate import MIN_P, GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.speculate import Drafter, SpecStats
from edge.config import SpeculativeConfig
from harness.ggufgen import byte_token
from kit.slots import Collect, greedy_gap

COPY = "The list: apple, pear, plum, fig. Again: apple, pear,"
LOGIT_BOUND = 1.5  # tests/model/test_slots.py: a batch's rounding on Gemma 3 270M (measured at most 1.07)
PROMPTS = ("Hello world", COPY, "abc abc abc abc", "One two three four five six")


def load(path: Path, mode: str = "ngram", parallel: int = 4, **spec: object) -> GGUFModel:
    cfg = ModelConfig(name="tiny", path=str(path), n_ctx=512, n_threads=1, use_mlock=False, parallel=parallel,
                      speculative=SpeculativeConfig(mode=mode, **spec))  # type: ignore[arg-type]
    return load_gguf_model(cfg, read_gguf_info(path))


@pytest.fixture(params=["tiny_gguf", "tiny_swa_gguf"])
def path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def run(m: GGUFModel, params: list[GenParams], prompts: tuple[str, ...] = PROMPTS) -> list[Collect]:
    sinks = []
    for prompt, p in zip(prompts, params):
        sinks.append(Collect())
        m.slots.start(Job(tokens=m.tokenize_prompt(prompt), params=p), sinks[-1])
    while m.slots.step():
        pass
    assert all(s.ended is None for s in sinks)
    return sinks


def both(path: Path, params: list[GenParams], **spec: object) -> tuple[list[str], list[str], SpecStats]:
    """The texts without speculation and with it, and the counters of the run with it."""
    texts = []
    for mode in ("off", "ngram"):
        m = load(path, mode, **spec)
        try:
            texts.append([s.text for s in run(m, params)])
            stats = m.slots.spec_stats
            for s in m.slots.slots:  # what each slot's cells hold is what the prompt cache says
                assert m.native.pos_max(s.id) == len(m.cache.live(s.id)) - 1
        finally:
            m.close()
    return texts[0], texts[1], stats


def test_greedy_text_is_the_same_with_and_without_proposals(path: Path) -> None:
    """Four sequences in one batch, proposals verified beside the others' tokens: bit for bit."""
    off, on, stats = both(path, [GenParams(max_tokens=60, temperature=0)] * 4)
    assert on == off
    assert stats.accepted > 0 and stats.steps > 0


def test_seeded_draws_are_the_same_with_and_without_proposals(path: Path) -> None:
    """At temperature 1 the chain draws one number per token either way: with the same seed the
    text is the same, rejected proposals (most of them here) included. (Short: a longer context
    changes the rounding of a batch's logits -- measured up to 2e-3 at 70 positions, with or
    without proposals, as batching itself does -- and at temperature 1 such a change may in time
    move a draw across a boundary; the distribution is what the next test holds.)"""
    params = [GenParams(max_tokens=24, temperature=1.0, seed=s) for s in range(4)]
    off, on, stats = both(path, params, ngram_min=1, min_acceptance=0.0)
    assert on == off
    assert stats.drafted > stats.accepted  # rejections were exercised


def test_stop_strings_logprobs_and_max_tokens_hold(path: Path) -> None:
    """A stop string inside accepted proposals ends the text where it would; logprobs come from
    each token's own row (the same, within the rounding a different batch shape brings);
    max_tokens is never outrun by a proposal."""
    greedy = GenParams(max_tokens=50, temperature=0)
    text = both(path, [greedy] * 4)[0][1]
    stop = text[12:14] if len(text) > 14 else "zz"
    params = [GenParams(max_tokens=7, temperature=0), GenParams(max_tokens=50, temperature=0, stop=(stop,)),
              GenParams(max_tokens=30, temperature=0, logprobs=2), GenParams(max_tokens=1, temperature=0)]
    runs = []
    for mode in ("off", "ngram"):
        m = load(path, mode)
        try:
            sinks = [Collect() for _ in params]
            jobs = [Job(tokens=m.tokenize_prompt(p), params=g) for p, g in zip(PROMPTS, params)]
            for j, s in zip(jobs, sinks):
                m.slots.start(j, s)
            lps = []
            orig = sinks[2].put
            sinks[2].put = lambda piece: (lps.extend((e.token, e.logprob) for e in piece.logprobs),
                                          orig(piece))[1]
            while m.slots.step():
                pass
            runs.append(([s.text for s in sinks], [s.finish for s in sinks], [j.completion_tokens for j in jobs], lps))
        finally:
            m.close()
    assert runs[0][:3] == runs[1][:3]
    (off, on) = (runs[0][3], runs[1][3])
    assert [t for t, _ in off] == [t for t, _ in on] and len(on) == 30
    assert max(abs(a - b) for (_, a), (_, b) in zip(off, on)) < 1e-3  # the batch's rounding, no more
    assert runs[1][2][0] == 7 and runs[1][2][3] == 1


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile (Wilson-Hilferty) at the normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_token_that_verifies_a_proposal_follows_the_target_distribution(tiny_gguf: Path) -> None:
    """The rejection rule, statistically: temperature 1, min-p only, a 1-gram proposal after the
    first token (every byte is in the prompt). The second token -- the proposal kept
    where it is the draw, else a draw from the rest -- over 400 seeds, against the model's own
    distribution after the prompt and the first token (softmax over what min-p keeps), through
    the randomised probability integral transform in 10 bins: chi-square at p = 0.001; and the proposal was kept as often as its probabilities
    say (within 4 standard deviations)."""
    m = load(tiny_gguf, "ngram", parallel=1, ngram_min=1, ngram_max=1, min_acceptance=0.0)
    try:
        toks = [m.native.bos] + [byte_token(b) for b in range(256)]  # every byte: a 1-gram match for any first token
        runs: list[tuple[int, int, int]] = []  # (first token, second token, proposal)
        for seed in range(400):
            params = GenParams(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, seed=seed)
            m.slots.start(Job(tokens=toks, params=params), Collect())
            seq, drafted = m.slots.active[-1], m.slots.spec_stats.drafted
            while m.slots.step():
                pass
            if m.slots.spec_stats.drafted > drafted:  # the proposal: what the drafter saw after the first token
                first = seq.out.tokens[0]
                second = seq.out.tokens[1] if len(seq.out.tokens) > 1 else m.native.eos  # an end is not kept
                runs.append((first, second, Drafter(m.slots.spec, toks + [first]).propose(1)[0]))
        assert len(runs) >= 300, f"{len(runs)} runs verified a proposal"
        dists = {}
        for first in {r[0] for r in runs}:  # the target's distribution after the prompt and each first token
            with m.slots.spare(toks + [first], len(toks) + 1) as seq_id:
                m.cache.reset(seq_id)
                m.native.decode(seq_id, toks + [first], 0)
                dists[first] = _min_p(m.native.logits().astype(np.float64))
                m.cache.reset(seq_id)
    finally:
        m.close()
    # the randomised probability integral transform: uniform on [0, 1) when the token is a draw from p
    rng = np.random.default_rng(0)
    bins = Counter()
    kept = kept_expected = kept_var = 0.0
    for first, second, draft in runs:
        p = dists[first]
        assert p[second] > 0  # nothing min-p drops
        below = float(p[:second].sum())
        bins[min(9, int(10 * (below + rng.random() * p[second])))] += 1
        kept += second == draft
        kept_expected += p[draft]
        kept_var += p[draft] * (1 - p[draft])
    chi2 = sum((bins[b] - len(runs) / 10) ** 2 / (len(runs) / 10) for b in range(10))
    assert chi2 < _chi2_critical(9), (chi2, bins)
    assert abs(kept - kept_expected) < 4 * math.sqrt(kept_var) + 1, (kept, kept_expected)


def _min_p(logits: np.ndarray) -> np.ndarray:
    """Temperature 1 with min-p alone: softmax over the logits min-p keeps (llama.cpp's, on logits)."""
    keep = logits >= logits.max() + math.log(MIN_P)
    p = np.where(keep, np.exp(logits - logits.max()), 0.0)
    return p / p.sum()


def test_proposals_grow_while_kept_and_pause_where_they_fail() -> None:
    """START_DRAFT tokens first, twice as many after a step that kept them all, what was kept and
    one more after one that did not; acceptance under the floor after min_drafted tokens: no
    proposal for PAUSE_STEPS steps, then again; the pause doubles while they keep failing."""
    cfg = SpeculativeConfig(ngram_min=2, ngram_max=3, max_draft=4, min_acceptance=0.5, min_drafted=4)
    d = Drafter(cfg, [1, 2, 3, 4, 5, 1, 2])
    stats = SpecStats()
    assert d.propose(8) == [3, 4]  # after the latest "1 2": the longest match first, START_DRAFT tokens
    d.judge(2, 2, stats)
    assert d.propose(8) == [3, 4, 5, 1] and d.propose(2) == [3, 4]  # grown to max_draft; a step's room caps it
    d.judge(4, 1, stats)  # 3 of 6 kept so far: judged, not under the floor
    assert stats.paused == 0 and d.propose(8) == [3, 4]
    d.judge(2, 0, stats)
    assert d.propose(8) == [3]
    d.judge(1, 0, stats)
    d.judge(1, 0, stats)  # 0 of 4 since the last verdict: a pause
    assert stats.paused == 1
    assert [d.propose(4) for _ in range(16)] == [[]] * 16
    assert d.propose(4) == [3]
    d.judge(4, 0, stats)
    assert sum(1 for _ in range(40) if not d.propose(4)) == 32
    d.push(3)
    assert d.propose(4) == [4]  # "1 2 3" seen before: its continuation
    d.push(9)
    assert d.propose(4) == []  # "3 9" never seen


def test_the_config_names_the_field_it_rejects() -> None:
    base = '[[models]]\nname = "m"\npath = "m.gguf"\n[models.speculative]\n'
    cfg = parse_config(base + 'mode = "ngram"\nmax_draft = 4\n')
    assert cfg.models[0].speculative.max_draft == 4
    for body, field, said in (('mode = "medusa"', "models[0].speculative.mode", "off"),
                              ("ngram_min = 5\nngram_max = 3", "models[0].speculative.ngram_min", "ngram_max"),
                              ("max_draft = 0", "models[0].speculative.max_draft", "")):
        with pytest.raises(ConfigError) as err:
            parse_config(base + body + "\n")
        assert field in str(err.value) and said in str(err.value)


GEMMA_PROMPTS = (
    "Fruit: apple, banana, cherry, date, elderberry, fig, grape.\nThe same fruit as a list, one per line:\n- apple\n-",
    "def area(width, height):\n    return width * height\n\n# the same function, renamed to rect_area:\ndef rect_area(",
    "Name: Ada Lovelace. Born: 10 December 1815. Field: mathematics.\nJSON: {\"name\": \"Ada Lovelace\", \"born\":",
    "Write one sentence about the sea.",
)


@pytest.mark.gemma
def test_on_gemma_greedy_text_is_the_same_and_copies_are_accepted(gemma_path: Path) -> None:
    """Gemma 3 270M, greedy: a list rewritten, a code edit, an extraction and prose, one at a time
    (parallel 1: the batch shapes differ only by the proposals). The text with speculation is the
    text without it, except where llama.cpp's rounding of a several-row batch (the bound batching
    already has, docs/internals.md "Serving many clients") tips a near-tie: there every token of it
    is still greedy's choice within LOGIT_BOUND, checked token by token. The copy-heavy prompts
    accept most proposals and take fewer steps."""
    tokens, steps, ms = {}, {}, {}
    for mode in ("off", "ngram"):
        m = ms[mode] = load_gguf_model(ModelConfig(name="g", path=str(gemma_path), n_ctx=1024, n_threads=2,
                                                   use_mlock=False, parallel=1,
                                                   speculative=SpeculativeConfig(mode=mode)), read_gguf_info(gemma_path))
        tokens[mode] = []
        for prompt in GEMMA_PROMPTS:
            m.slots.start(Job(tokens=m.tokenize_prompt(prompt), params=GenParams(max_tokens=48, temperature=0)),
                          Collect())
            seq = m.slots.active[-1]
            while m.slots.step():
                pass
            tokens[mode].append(seq.out.tokens)
        steps[mode], stats = m.slots.stats.steps, m.slots.spec_stats
    try:
        same = sum(a == b for a, b in zip(tokens["off"], tokens["ngram"]))
        assert same >= 3, tokens
        for prompt, got in zip(GEMMA_PROMPTS, tokens["ngram"]):
            toks = ms["off"].tokenize_prompt(prompt)
            assert greedy_gap(ms["off"], toks + got, len(toks)) <= LOGIT_BOUND
    finally:
        for m in ms.values():
            m.close()
    assert stats.accepted >= 0.5 * stats.drafted > 0 and steps["ngram"] < 0.8 * steps["off"], (stats.__dict__, steps)
