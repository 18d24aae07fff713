"""A grammar's cost stays its own (edge.model.constrained.StepBudget, through edge.model.slots):
with the step's grammar budget at zero and passes of 16 candidates, every pass of a grammar
sequence beside others is set aside after its first chunk and goes on at the next step, and
still each sequence gives what it gives alone (greedy and seeded, logprobs included); a plain
sequence beside them takes one token a step as if they were not there; a sequence alone is never
set aside; one cancelled while set aside ends at the next step."""

from __future__ import annotations

from pathlib import Path

import pytest

import edge.model.candidates as candidates_mod
import edge.model.constrained as constrained_mod
from edge.config import ModelConfig
from edge.model.generate import GenParams, Job, Piece
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.serve.schema import schema_grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


class Sink:
    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.ended: BaseException | None | str = "open"

    def put(self, piece: Piece) -> None:
        self.pieces.append(piece)

    def close(self, error: BaseException | None) -> None:
        self.ended = error

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


@pytest.fixture
def m(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(candidates_mod, "CHUNK", 16)
    monkeypatch.setattr(candidates_mod, "MIN_CHUNK", 16)
    monkeypatch.setattr(constrained_mod, "GRAMMAR_SHARE", 0.0)
    monkeypatch.setattr(constrained_mod, "GRAMMAR_MIN_S", 0.0)
    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=512, n_threads=1, use_mlock=False, parallel=4)
    model = load_gguf_model(cfg, read_gguf_info(tiny_gguf))
    yield model
    model.close()


def jobs(m: GGUFModel, grammar: object, temperature: float) -> list[Job]:
    prompts = ("Hello world", "the a e", "tea and a world")
    return [Job(tokens=m.tokenize_prompt(p), cache_prompt=False, remember=False,
                params=GenParams(max_tokens=40, temperature=temperature, seed=i + 1, logprobs=2 if i == 1 else None,
                                 grammar=None if i == 0 else grammar)) for i, p in enumerate(prompts)]


def batched(m: GGUFModel, batch: list[Job]) -> tuple[list[Sink], list[int]]:
    """Every job's pieces, and the steps each one took."""
    sinks = [Sink() for _ in batch]
    for j, s in zip(batch, sinks):
        m.slots.start(j, s)
    chains = [seq.chain for seq in m.slots.active]
    steps, took = 0, [0] * len(batch)
    while m.slots.step():
        steps += 1
        for i, s in enumerate(sinks):
            took[i] = took[i] or (steps if s.ended != "open" else 0)
    m.sets_aside = sum(c._g.set_aside for c in chains if c._g is not None)  # type: ignore[attr-defined]
    return sinks, took


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_passes_set_aside_give_each_sequence_what_it_gives_alone(m: GGUFModel, temperature: float) -> None:
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x", json=True)
    alone = [list(m.generate(j)) for j in jobs(m, compiled, temperature)]
    sinks, took = batched(m, jobs(m, compiled, temperature))
    compiled.close()
    assert m.sets_aside > 0  # type: ignore[attr-defined]
    assert [s.text for s in sinks] == ["".join(p.text for p in a) for a in alone]
    got, want = ([(t.token, t.logprob) for p in pieces for t in p.logprobs] for pieces in (sinks[1].pieces, alone[1]))
    # read from the rows kept when set aside (a batch's rows differ from a row alone in the last bits)
    assert [t for t, _ in got] == [t for t, _ in want] and [lp for _, lp in got] == pytest.approx(
        [lp for _, lp in want], abs=1e-4) and len(got) == 40
    assert all(s.ended is None for s in sinks)
    plain_steps = took[0]
    assert plain_steps <= 1 + 40 and max(took[1:]) > plain_steps  # one token a step, whatever is beside it


def test_a_sequence_alone_is_never_set_aside(m: GGUFModel) -> None:
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x", json=True)
    sinks, _ = batched(m, jobs(m, compiled, 1.0)[1:2])
    compiled.close()
    assert m.sets_aside == 0 and sinks[0].ended is None  # type: ignore[attr-defined]


def test_a_sequence_cancelled_while_set_aside_ends_at_the_next_step(m: GGUFModel) -> None:
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x", json=True)
    batch = jobs(m, compiled, 1.0)
    sinks = [Sink() for _ in batch]
    for j, s in zip(batch, sinks):
        m.slots.start(j, s)
    while not any(seq.chain.pending for seq in m.slots.active):
        assert m.slots.step()
    pending = next(seq for seq in m.slots.active if seq.chain.pending)
    before = len(pending.sink.pieces)
    pending.job.cancel.set()
    m.slots.step()
    assert pending not in m.slots.active and pending.sink.ended is None and len(pending.sink.pieces) == before
    while m.slots.step():
        pass
    compiled.close()
    assert [s.ended for s in sinks] == [None] * 3
