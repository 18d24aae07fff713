"""Continuous batching (edge.model.slots) on real tiny llama.cpp contexts: sequences decoded
together give what each gives alone, one step holds every generating sequence's token and a
prompt chunk, choices of one prompt share its prefill, and a sequence that is cancelled or runs
out of time leaves its slot at the next step while the others go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.errors import RequestError
from edge.model.generate import GenParams, Hold, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from kit.slots import Collect

PROMPTS = ("Hello world", "The quick brown fox", "One two three four five six", "tea and a world")


def load(path: Path, **fields: object) -> GGUFModel:
    cfg = ModelConfig(**{"name": "tiny", "path": str(path), "n_ctx": 512, "n_threads": 1,  # type: ignore[arg-type]
                         "use_mlock": False, "parallel": 4, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


@pytest.fixture(params=["tiny_gguf", "tiny_swa_gguf"])
def model(request: pytest.FixtureRequest) -> GGUFModel:
    m = load(request.getfixturevalue(request.param))
    yield m
    m.close()


def job(m: GGUFModel, prompt: str, n: int = 20, **kw: object) -> Job:
    return Job(tokens=m.tokenize_prompt(prompt), params=GenParams(max_tokens=n, temperature=0), **kw)  # type: ignore[arg-type]


def run_all(m: GGUFModel, jobs: list[Job]) -> list[Collect]:
    sinks = [Collect() for _ in jobs]
    for j, s in zip(jobs, sinks):
        assert m.slots.fits(j)
        m.slots.start(j, s)
    while m.slots.step():
        pass
    return sinks


def alone(m: GGUFModel, prompt: str, n: int = 20) -> str:
    return "".join(p.text for p in m.generate(job(m, prompt, n, cache_prompt=False, remember=False)))


def test_each_sequence_of_a_batch_gives_what_it_gives_alone(model: GGUFModel) -> None:
    """Greedy, bit for bit on these tiny models (docs/internals.md "Serving many clients": the measured
    bound on the real one), a prompt given twice included."""
    want = [alone(model, p) for p in (*PROMPTS, PROMPTS[0])]
    got = run_all(model, [job(model, p) for p in (*PROMPTS, PROMPTS[0])][:4])
    assert [s.text for s in got] == want[:4]
    assert all(s.ended is None and s.finish == "length" for s in got)
    assert model.slots.busy == 0 and sorted(model.slots.idle) == [0, 1, 2, 3]


def test_one_step_holds_every_generating_sequence_and_a_prompt_chunk(tiny_gguf: Path) -> None:
    """n_batch 16: a long prompt arriving while two sequences generate is prefilled 14 tokens a
    step, beside their two tokens; they get a token at every step meanwhile."""
    m = load(tiny_gguf, n_batch=16)
    try:
        short = [job(m, p, 40) for p in PROMPTS[:2]]
        sinks = [Collect() for _ in short]
        for j, s in zip(short, sinks):
            m.slots.start(j, s)
        m.slots.step()  # both prompts (12 and 20 tokens) in one 16-token budget: the second's rest later
        while not all(s.generating for s in m.slots.active):
            m.slots.step()
        long = job(m, "word " * 30, 4)
        m.slots.start(long, Collect())
        before = [j.completion_tokens for j in short]
        steps = 0
        while not long.prefilled or m.slots.active[-1].done < len(long.tokens):
            m.slots.step()
            steps += 1
            assert m.slots.stats.last_batch <= 16 and m.slots.stats.last_sequences == 3
        assert steps == -(-len(long.tokens) // 14)
        assert [j.completion_tokens for j in short] == [b + steps for b in before]
    finally:
        m.close()


def test_choices_of_one_prompt_share_its_prefill(model: GGUFModel) -> None:
    jobs = [job(model, PROMPTS[2]) for _ in range(3)]
    before = model.slots.stats.shared_prompts
    got = run_all(model, jobs)
    assert model.slots.stats.shared_prompts - before == 2  # computed once, taken twice (seq_cp)
    assert len({s.text for s in got}) == 1 and got[0].text == alone(model, PROMPTS[2])
    assert [j.cached_tokens for j in jobs[1:]] == [len(jobs[0].tokens)] * 2


def test_a_cancelled_sequence_leaves_its_slot_at_the_next_step(model: GGUFModel) -> None:
    jobs = [job(model, p, 30) for p in PROMPTS[:2]]
    sinks = [Collect() for _ in jobs]
    for j, s in zip(jobs, sinks):
        model.slots.start(j, s)
    for _ in range(4):
        model.slots.step()
    jobs[0].cancel.set()
    made = jobs[0].completion_tokens
    model.slots.step()
    assert sinks[0].ended is None and jobs[0].completion_tokens == made and model.slots.busy == 1
    while model.slots.step():
        pass
    assert sinks[1].finish == "length" and sinks[1].text == alone(model, PROMPTS[1], 30)


def test_a_request_past_its_time_ends_with_a_422_and_the_others_go_on(model: GGUFModel) -> None:
    late = job(model, PROMPTS[0], 30, hold=Hold(limit_s=0.0))
    other = job(model, PROMPTS[1], 30)
    got = run_all(model, [late, other])
    assert isinstance(got[0].ended, RequestError) and got[0].ended.status == 422
    assert late.completion_tokens == 1  # checked after its first token
    assert got[1].finish == "length" and got[1].text == alone(model, PROMPTS[1], 30)


def test_on_the_real_model_a_sequence_of_a_batch_sees_only_its_own_cells(gemma_path: Path) -> None:
    """docs/internals.md "Serving many clients": a sequence's logits decoded in one batch with
    others (one output row, or one per sequence) are bit for bit those it gets in the same batch
    beside other sequences of the same lengths: no sequence sees another's cells, and each row is
    computed as it would be whatever the others hold. Beside its logits decoded alone they differ
    by what llama.cpp's kernels do with another batch shape (other rounding: how much is the CPU's,
    so no bound of it is asserted; greedy texts can part at a near-tie)."""
    import numpy as np

    m = load_gguf_model(ModelConfig(name="g", path=str(gemma_path), n_ctx=1024, n_threads=2, use_mlock=False,
                                    parallel=4), read_gguf_info(gemma_path))
    n = m.native
    try:
        words = "apple river stone cloud forest garden window bridge candle market silver orange".split()
        prompts = [m.tokenize_prompt(" ".join(words[i:] + words[:i]) * 2) for i in range(4)]
        rng = np.random.default_rng(0)  # the other neighbours: their tokens shuffled, their lengths kept
        others = [[t[0], *(int(x) for x in rng.permutation(t[1:]))] for t in prompts[:3]] + [prompts[3]]
        assert all(a != b for a, b in zip(others[:3], prompts[:3]))

        def batch(seqs: list[list[int]], last: bool) -> list[np.ndarray]:
            for i in range(4):
                n.clear(i)
            rows = [(i, p, tok) for i, t in enumerate(seqs) for p, tok in enumerate(t)]
            ends = sorted(sum(len(t) for t in seqs[:i + 1]) - 1 for i in range(4))
            out = [int(r in ends and (last or r == len(rows) - 1)) for r in range(len(rows))]
            n.decode_batch([tok for *_, tok in rows], [p for _, p, _ in rows], [i for i, *_ in rows], out)
            return [n.logits(r).copy() for r in ends if out[r]]

        for last in (False, True):  # one output row (the last prompt's), then one per prompt
            mine, beside_others = batch(prompts, last), batch(others, last)
            assert np.array_equal(mine[-1], beside_others[-1])  # the last sequence's row, bit for bit
            assert not last or not np.array_equal(mine[0], beside_others[0])  # the neighbours' rows did change
    finally:
        m.close()
