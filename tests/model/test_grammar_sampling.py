"""Grammar-constrained sampling (edge.model.generate.SamplerChain) on a real llama.cpp context:
the lazy way (sample without the grammar, check that one token, go over every candidate only
when it is rejected) gives the tokens the grammar over every candidate gives, on the tiny GGUF
and on Gemma 3 270M, with logit bias and penalties in their places."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import edge.model.generate as generate_mod
from edge.config import ModelConfig
from edge.model.generate import GenParams, Job, SamplerChain
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["ok"]},
    {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,3}$"},
]


def gbnf(schema: dict) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(schema))


def load(path: Path, n_ctx: int = 512, threads: int = 1) -> GGUFModel:
    cfg = ModelConfig(name="m", path=str(path), n_ctx=n_ctx, n_batch=64, n_threads=threads, use_mlock=False)
    return load_gguf_model(cfg, read_gguf_info(path))


class Counted:
    """SamplerChain as generate() builds it, remembering each chain (to read `resampled`)."""

    def __init__(self, lazy: bool) -> None:
        self.lazy, self.chains = lazy, []

    def __call__(self, native, p):  # noqa: ANN001
        chain = SamplerChain(native, p, lazy=self.lazy)
        self.chains.append(chain)
        return chain


def run(m: GGUFModel, prompt: str, params: GenParams, lazy: bool,
        monkeypatch: pytest.MonkeyPatch) -> tuple[str, str | None, int, int, int]:
    """(text, finish reason, completion tokens, tokens sampled again under the grammar, of
    those the ones the grammar went over the whole vocabulary for)."""
    made = Counted(lazy)
    monkeypatch.setattr(generate_mod, "SamplerChain", made)
    job = Job(tokens=m.tokenize_prompt(prompt), params=params, cache_prompt=False)
    pieces = list(m.generate(job))
    monkeypatch.setattr(generate_mod, "SamplerChain", SamplerChain)
    chain = made.chains[0]
    return "".join(p.text for p in pieces), pieces[-1].finish_reason, job.completion_tokens, chain.resampled, \
        chain.full_passes


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path):
    m = load(tiny_gguf)
    yield m
    m.close()


def test_lazy_grammar_gives_the_tokens_of_the_grammar_over_every_candidate(tiny: GGUFModel,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    resampled = top_only = reference = 0
    for schema in SCHEMAS:
        for prompt in ("Hello world. the a", "the e"):
            params = GenParams(max_tokens=40, temperature=0, grammar=gbnf(schema))
            full = run(tiny, prompt, params, lazy=False, monkeypatch=monkeypatch)
            lazy = run(tiny, prompt, params, lazy=True, monkeypatch=monkeypatch)
            assert lazy[:3] == full[:3], (schema, prompt)
            # the reference goes over every candidate for every token sampled
            assert full[3] == full[4] == full[2] + (full[1] == "stop")
            resampled, top_only, reference = resampled + lazy[3], top_only + lazy[3] - lazy[4], reference + full[3]
    # lazily: only where the grammar rejected the model's own choice, which it sometimes does;
    # and then mostly decided among the likeliest candidates
    assert 0 < resampled < reference and top_only > 0


def test_bias_and_penalties_come_before_the_grammar_in_both_ways(tiny: GGUFModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    base = GenParams(max_tokens=30, temperature=0, grammar=gbnf(SCHEMAS[0]))
    plain = run(tiny, "Hello world. the e", base, lazy=True, monkeypatch=monkeypatch)
    toks = tiny.tokenize_text(plain[0])
    first = max(set(toks), key=toks.count)  # the commonest token of the answer: banned, it changes it
    for extra in ({"logit_bias": ((first, -100.0),)}, {"logit_bias": ((first, 3.0), (first, 4.5), (7, 20.0))},
                  {"presence_penalty": 1.5, "frequency_penalty": 0.5},
                  {"logit_bias": ((first, 30.0),), "presence_penalty": 2.0}):
        p = GenParams(**{**base.__dict__, **extra})
        full = run(tiny, "Hello world. the e", p, lazy=False, monkeypatch=monkeypatch)
        lazy = run(tiny, "Hello world. the e", p, lazy=True, monkeypatch=monkeypatch)
        assert lazy[:3] == full[:3], extra
    assert run(tiny, "Hello world. the e", GenParams(**{**base.__dict__, "logit_bias": ((first, -100.0),)}),
               lazy=True, monkeypatch=monkeypatch)[0] != plain[0]


def test_seeded_sampling_under_a_grammar_repeats_and_keeps_to_it(tiny: GGUFModel,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    p = GenParams(max_tokens=60, temperature=1.0, seed=7, grammar=gbnf(SCHEMAS[1]))
    a = run(tiny, "Hello world.", p, lazy=True, monkeypatch=monkeypatch)
    b = run(tiny, "Hello world.", p, lazy=True, monkeypatch=monkeypatch)
    assert a == b
    if a[1] == "stop":
        assert all(x in ("red", "green", "blue") for x in json.loads(a[0]))


def test_a_grammar_that_can_only_end_with_a_banned_end_token_stops(tiny: GGUFModel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar's end allows only end-of-generation tokens, and logit_bias bans them: no
    token is left; the generation stops there (llama.cpp's grammar would abort the process if
    it were made to accept any other)."""
    n = tiny.native
    ends = [t for t in range(n.n_vocab) if n.is_eog(t)]
    p = GenParams(max_tokens=20, temperature=0, grammar='root ::= "ab"',
                  logit_bias=tuple((t, -100.0) for t in ends))
    for lazy in (False, True):
        text, finish, *_ = run(tiny, "Hello", p, lazy=lazy, monkeypatch=monkeypatch)
        assert (text, finish) == ("ab", "stop")


@pytest.mark.gemma
def test_gemma_lazy_grammar_gives_the_same_json(gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = load(gemma_path, n_ctx=1024, threads=2)
    try:
        prompts = ["A person described as JSON: ", "Colors, as a JSON list: ", "Settings:\n", "Code: "]
        resampled = tokens = top_only = 0
        for schema, prompt in zip(SCHEMAS, prompts):
            params = GenParams(max_tokens=32, temperature=0, grammar=gbnf(schema))
            full = run(m, prompt, params, lazy=False, monkeypatch=monkeypatch)
            lazy = run(m, prompt, params, lazy=True, monkeypatch=monkeypatch)
            assert lazy[:3] == full[:3], schema
            if lazy[1] == "stop":
                json.loads(lazy[0])  # a whole value of the schema
            resampled, tokens, top_only = resampled + lazy[3], tokens + lazy[2], top_only + lazy[3] - lazy[4]
        assert resampled < tokens and top_only > 0
    finally:
        m.close()
