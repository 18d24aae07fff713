"""The grammar's full pass over the candidates in chunks (edge.model.candidates.apply_grammar):
the same tokens as one pass, and a `check` between chunks ends a sampling step in the middle of
the pass (a request's deadline, a drain, a client that left), on the tiny GGUF."""

from __future__ import annotations

import pytest

import edge.model.candidates as candidates_mod
from edge.model.generate import GenParams, Job, SamplerChain
from edge.model.llm import GGUFModel
from edge.serve.schema import schema_grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def prefilled(m: GGUFModel) -> None:
    """The context's last logits: a prompt decoded (one token generated, no grammar)."""
    list(m.generate(Job(tokens=m.tokenize_prompt("Hello world. the a"), params=GenParams(max_tokens=1),
                        cache_prompt=False)))


def test_a_chunked_pass_samples_the_tokens_of_one_pass(grammar_walk: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = grammar_walk
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x")
    texts = []
    for chunk in (10**9, 16):  # one pass, then 16 candidates at a time
        monkeypatch.setattr(candidates_mod, "CHUNK", chunk)
        monkeypatch.setattr(candidates_mod, "MIN_CHUNK", min(chunk, 256))
        for seed in range(3):
            job = Job(tokens=m.tokenize_prompt("the e"), params=GenParams(max_tokens=30, temperature=1.0, seed=seed,
                                                                           grammar=compiled), cache_prompt=False)
            texts.append("".join(p.text for p in m.generate(job)))
    compiled.close()
    assert texts[:3] == texts[3:] and any(texts)


def test_a_check_ends_the_step_inside_the_full_pass(grammar_walk: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = grammar_walk
    monkeypatch.setattr(candidates_mod, "CHUNK", 16)
    monkeypatch.setattr(candidates_mod, "MIN_CHUNK", 16)
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x")
    prefilled(m)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise TimeoutError("the deadline")

    chain = SamplerChain(m.native, GenParams(max_tokens=1, temperature=1.0, seed=1, grammar=compiled), lazy=False)
    try:
        with pytest.raises(TimeoutError):
            chain.sample(check=check)
        assert len(calls) == 3 and m.native.n_vocab > 3 * 16  # ended after 2 of the pass's chunks
        assert chain.sample() is not None  # the chain is still usable: the next step samples
    finally:
        chain.close()
        compiled.close()


def test_a_cancelled_job_ends_inside_the_pass_without_a_piece_after_it(grammar_walk: tuple,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = grammar_walk
    monkeypatch.setattr(candidates_mod, "CHUNK", 16)
    monkeypatch.setattr(candidates_mod, "MIN_CHUNK", 16)
    compiled = m.compile_grammar(schema_grammar(SCHEMA, "x"), "x")
    job = Job(tokens=m.tokenize_prompt("the e"), params=GenParams(max_tokens=200, temperature=1.0, seed=2,
                                                                   grammar=compiled), cache_prompt=False)
    seen = []
    original = candidates_mod.Candidates.apply_grammar

    def cancelling(self, grammar, check):  # noqa: ANN001, ANN202
        job.cancel.set()  # the client left while the grammar goes over the candidates
        seen.append(job.completion_tokens)
        return original(self, grammar, check)

    monkeypatch.setattr(candidates_mod.Candidates, "apply_grammar", cancelling)
    pieces = list(m.generate(job))
    compiled.close()
    # ended inside that step: the token being sampled was never taken, no piece says it finished
    assert seen and job.completion_tokens == seen[0] and all(p.finish_reason is None for p in pieces)
