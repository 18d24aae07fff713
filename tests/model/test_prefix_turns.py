"""Prefixes that take turns, served by the slots (edge.model.slots) as `edge serve` serves them:
undeclared long prefixes, each followed by a novel question, sent in strict turns (A B A B ...,
A B C A B C ...). Every repeat reuses at least 90 % of its prompt whatever the slot count: its
slot's cells where they are still there, else a saved state restored into whichever slot it
lands on (a sliding-window model's windowed states included)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from edge.config import ModelConfig
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from kit.slots import Collect

ROUNDS = 4


def ask(m: GGUFModel, tokens: list[int]) -> Job:
    """One request through the slots, alone, to its end."""
    job = Job(tokens=tokens, params=GenParams(max_tokens=1, temperature=0))
    assert m.slots.fits(job)
    sink = Collect()
    m.slots.start(job, sink)
    while m.slots.step():
        pass
    assert sink.ended is None and m.slots.pending == 0
    return job


def turns(m: GGUFModel, prefixes: list[list[int]], question: "callable") -> list[tuple[int, int]]:
    """ROUNDS rounds of the prefixes in turns; (cached, prompt tokens) of every repeat."""
    out = []
    for rnd in range(ROUNDS):
        for p in prefixes:
            job = ask(m, p + question())
            if rnd:
                out.append((job.cached_tokens, len(job.tokens)))
            else:
                assert job.cached_tokens <= 1
    return out


def load(path: Path, **fields: object) -> GGUFModel:
    cfg = ModelConfig(**{"name": "m", "path": str(path), "n_threads": 2, "use_mlock": False, **fields})  # type: ignore[arg-type]
    return load_gguf_model(cfg, read_gguf_info(path))


# -- the tiny Gemma 3 (a 32-token window): every slot count, a context that holds them all or not ----
@pytest.mark.parametrize("n_prefixes", [2, 3])
@pytest.mark.parametrize("parallel", [1, 4, 8])
@pytest.mark.parametrize("n_ctx", [512, 1024])
def test_tiny_prefixes_in_turns_are_reused_at_any_slot_count(tiny_swa_gguf: Path, parallel: int, n_prefixes: int,
                                                             n_ctx: int) -> None:
    m = load(tiny_swa_gguf, n_ctx=n_ctx, n_batch=64, parallel=parallel)
    try:
        rng = np.random.default_rng(parallel * 10 + n_prefixes)
        prefixes = [[1, 3 + i] + [int(t) for t in rng.integers(3, 268, 198)] for i in range(n_prefixes)]
        got = turns(m, prefixes, lambda: [int(t) for t in rng.integers(3, 268, 8)])
        assert all(c >= 0.9 * n for c, n in got), got
    finally:
        m.close()


# -- the real Gemma 3 270M (a 512-token window) -------------------------------------------------------
WORDS = ("apple river stone cloud forest garden window bridge candle market silver orange basket "
         "mirror pencil rabbit engine harbor island ladder").split()


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


SETTINGS = {"default": {}, "parallel 1": {"parallel": 1}, "parallel 4": {"parallel": 4}, "parallel 8": {"parallel": 8},
            "n_ctx 2048, parallel 8": {"n_ctx": 2048, "parallel": 8}}  # the last: three prompts do not fit at once


@pytest.mark.gemma
@pytest.mark.parametrize("n_prefixes", [2, 3])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_gemma_prefixes_in_turns_are_reused_at_the_default_config_and_any_slot_count(
        gemma_path: Path, settings: str, n_prefixes: int) -> None:
    """The issue's bars: ~800-token prefixes, a novel 24-token question each, in turns; the
    default config (n_ctx and parallel from the model and the memory), parallel 1, 4, 8, and a
    context too small to keep them all in cells (saved states restored, cut back with their
    window piece)."""
    m = load(gemma_path, **SETTINGS[settings])
    try:
        assert m.native.n_swa == 512
        prefixes = [m.tokenize_prompt(words(100 + i, 800))[:800] for i in range(n_prefixes)]
        seeds = iter(range(1000, 1100))
        got = turns(m, prefixes, lambda: m.tokenize_text(" " + words(next(seeds), 30))[:24])
        assert all(c >= 0.9 * n for c, n in got), got
        assert m.cache.nbytes <= m.cache.limit_bytes
    finally:
        m.close()
