"""Who gets a context's cells (edge.model.admission) on real tiny llama.cpp contexts: requests
start beside running ones whose answers may still grow, idle slots give their cached sequences
up least recently used first, a sequence that outgrows the context is suspended and resumed
with the same answer, and requests start in the order they came."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.sequence import SlotState
from kit.slots import Collect, greedy_gap

PROMPTS = ("Hello world", "The quick brown fox", "One two three four five six", "tea and a world")


def load(path: Path, **fields: object) -> GGUFModel:
    cfg = ModelConfig(**{"name": "tiny", "path": str(path), "n_ctx": 128, "n_threads": 1,  # type: ignore[arg-type]
                         "use_mlock": False, "parallel": 4, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


@pytest.fixture(params=["tiny_gguf", "tiny_swa_gguf"])
def model(request: pytest.FixtureRequest) -> GGUFModel:
    m = load(request.getfixturevalue(request.param))
    yield m
    m.close()


def job(m: GGUFModel, prompt: str, n: int, **kw: object) -> Job:
    """Greedy, end of generation banned: every answer is n tokens long."""
    return Job(tokens=m.tokenize_prompt(prompt), params=GenParams(  # type: ignore[arg-type]
        max_tokens=n, temperature=0, logit_bias=((m.native.eos, -100.0),)), **kw)


def alone(m: GGUFModel, prompt: str, n: int) -> str:
    return "".join(p.text for p in m.generate(job(m, prompt, n, cache_prompt=False, remember=False)))


def drain(m: GGUFModel) -> int:
    steps = 0
    while m.slots.step():
        steps += 1
        assert steps < 10_000
    return steps


def test_a_request_starts_beside_one_whose_answer_may_fill_the_context(model: GGUFModel) -> None:
    """Cells are taken as tokens are decoded, not reserved for max_tokens: a request whose prompt
    fits starts at once beside one that may (but need not) take every cell."""
    n_ctx = model.native.n_ctx
    big = job(model, PROMPTS[0], n_ctx - len(model.tokenize_prompt(PROMPTS[0])))
    small = job(model, PROMPTS[1], 4)
    assert model.slots.fits(big)
    model.slots.start(big, Collect())
    assert model.slots.fits(small)  # the old admission waited here until the big one ended
    sink = Collect(model.slots)
    model.slots.start(small, sink)
    model.slots.step()
    assert small.prefilled and model.slots.busy == 2
    drain(model)
    assert sink.finish == "length" and sink.text == alone(model, PROMPTS[1], 4)


def test_a_sequence_that_outgrows_the_context_is_suspended_and_answers_as_if_it_had_not(model: GGUFModel) -> None:
    """Two long answers that cannot both fit: before the generating ones' next tokens would find
    no cells, the youngest gives its cells up (its state saved), waits, and is restored once the
    other ended. No error, every token of both is the greedy choice given the text before it
    (teacher-forced: a batch's other cell layout may flip a near-tie, kit.slots.greedy_gap), and
    the slots end free."""
    n_ctx = model.native.n_ctx
    first = job(model, PROMPTS[0], n_ctx - len(model.tokenize_prompt(PROMPTS[0])) - 1)
    second = job(model, PROMPTS[2], n_ctx // 2)
    sinks = [Collect(), Collect()]
    seqs = []
    for j, s in zip((first, second), sinks):
        model.slots.start(j, s)
        seqs.append(model.slots.active[-1])
    waiting = []
    while model.slots.step():
        waiting.append(model.slots.admission.waiting)
    assert model.slots.stats.suspended >= 1 and max(waiting) == 1 and model.slots.stats.retried == 0
    assert [s.ended for s in sinks] == [None, None] and [s.finish for s in sinks] == ["length", "length"]
    for j, seq in zip((first, second), seqs):
        assert len(seq.out.tokens) == j.params.max_tokens
        assert greedy_gap(model, j.tokens + seq.out.tokens, len(j.tokens), banned=(model.native.eos,)) < 1e-3
    assert second.cached_tokens == 0  # what its request reports: its prompt's reuse at its start, not the resume's
    assert model.slots.pending == 0 and all(s.state.free for s in model.slots.slots)


def test_a_suspended_sequence_whose_client_left_ends_without_coming_back(model: GGUFModel) -> None:
    n_ctx = model.native.n_ctx
    first = job(model, PROMPTS[0], n_ctx - len(model.tokenize_prompt(PROMPTS[0])) - 1)
    second = job(model, PROMPTS[2], n_ctx // 2)
    sinks = [Collect(), Collect()]
    model.slots.start(first, sinks[0])
    model.slots.start(second, sinks[1])
    while not model.slots.admission.waiting:
        assert model.slots.step()
    made = second.completion_tokens
    second.cancel.set()
    model.slots.step()
    assert sinks[1].ended is None and second.completion_tokens == made and model.slots.pending == 1
    drain(model)
    assert sinks[0].finish == "length"


def test_idle_slots_give_their_cells_up_least_recently_used_first(tiny_gguf: Path) -> None:
    m = load(tiny_gguf)
    try:
        for p in PROMPTS[:3]:  # three finished sequences, each its slot's cached prefix
            m.slots.start(job(m, p, 8), Collect())
            drain(m)
        cached = [s for s in m.slots.slots if s.state is SlotState.CACHED]
        assert len(cached) == 3
        order = sorted(cached, key=lambda s: s.used)
        held = sum(len(m.cache.live(s.id)) for s in cached)
        # a prompt that needs all but what the newest cached one holds: the two oldest give way
        room = m.native.n_ctx - len(m.cache.live(order[2].id)) - 8
        big = Job(tokens=m.tokenize_prompt("word " * 200)[:room], params=GenParams(max_tokens=2, temperature=0))
        assert len(m.cache.live(order[1].id)) > 8 and held + len(big.tokens) > m.native.n_ctx
        m.slots.start(big, Collect())
        drain(m)
        assert m.slots.stats.given_way == 2
        assert [s.state for s in order[:2]] != [SlotState.CACHED, SlotState.CACHED]
        assert m.cache.live(order[2].id)  # the most recently used kept its cells
    finally:
        m.close()


def test_requests_start_in_the_order_they_came_and_none_waits_more_than_its_share(model: GGUFModel) -> None:
    """16 requests on 4 slots, all at once, with cells for a few of them: they start in the order
    they were queued (the scheduler's queue: the head starts when it fits, suspended sequences
    before it), and the longest wait for a first piece (in steps) is within 2.5x the median
    (the queue's last waits about twice the median when every request is the same)."""
    jobs = [job(model, PROMPTS[i % 4], 40) for i in range(16)]
    sinks = [Collect(model.slots) for _ in jobs]
    started: list[int] = []
    queue = list(range(16))
    while queue or model.slots.pending:
        while queue and model.slots.fits(jobs[queue[0]]):  # what edge.model.scheduler does between steps
            started.append(queue[0])
            model.slots.start(jobs[queue.pop(0)], sinks[started[-1]])
        model.slots.step()
    assert started == list(range(16))
    assert all(s.ended is None and s.finish == "length" for s in sinks)
    waits = sorted(s.first_step for s in sinks)
    assert waits[-1] <= 2.5 * max(1.0, statistics.median(waits)), waits


def test_the_scheduler_thread_starts_requests_in_order_and_none_waits_more_than_its_share(model: GGUFModel) -> None:
    """The same through the model's own scheduler thread (edge.model.scheduler, what every
    worker submits to): 16 requests queued at once while it is held, then let go. They start in
    the order they were submitted, every answer is whole, and the longest wait for a first piece
    (in steps) is within 2.5x the median wait."""
    import threading

    class Sink(Collect):
        def __init__(self, slots: object) -> None:
            super().__init__(slots)
            self.done = threading.Event()

        def close(self, error: BaseException | None) -> None:
            super().close(error)
            self.done.set()

    started: list[Job] = []
    real_start = model.slots.start

    def start(j: Job, sink: object) -> None:  # runs on the scheduler thread
        started.append(j)
        real_start(j, sink)

    jobs = [job(model, PROMPTS[i % 4], 40) for i in range(16)]
    sinks = [Sink(model.slots) for _ in jobs]
    model.slots.start = start  # type: ignore[method-assign]
    try:
        model.scheduler.hold()
        for j, s in zip(jobs, sinks):
            model.scheduler.submit(j, s)
        model.scheduler.resume()
        assert all(s.done.wait(120) for s in sinks)
    finally:
        del model.slots.start
    assert [jobs.index(j) for j in started] == list(range(16))
    assert all(s.ended is None and s.finish == "length" for s in sinks)
    waits = sorted(s.first_step for s in sinks)
    assert waits[-1] <= 2.5 * max(1.0, statistics.median(waits)), waits
