"""LoRA adapters (edge.model.adapters) on the tiny generated model and a tiny generated LoRA
(harness.ggufgen.write_tiny_lora): the adapted logits are llama.cpp's own reference computation's
(llama-cpp-python's Llama(lora_path=...) on the same two files), scale 0 is the base, mixed
selections in one scheduler give each sequence what it gives alone, and the selections take the
steps in turns. Damaged or mismatched adapter files are refused with ModelError (exit 65)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.config import AdapterConfig, ModelConfig, parse_config
from edge.errors import EX_DATAERR, ConfigError, ModelError, RequestError
from edge.model.adapters import select
from edge.model.generate import GenParams, Job, Piece
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.savedstates import MIN_REUSE
from harness.ggufgen import write_tiny_lora
from kit.slots import greedy_gap

PROMPT = "Hello world. The"


class Collect:
    """A sequence's consumer (slots.Sink): its text and how it ended."""

    def __init__(self) -> None:
        self.text, self.ended = "", "open"

    def put(self, piece: Piece) -> None:
        self.text += piece.text

    def close(self, error: BaseException | None) -> None:
        self.ended = error


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    return {"a": write_tiny_lora(d / "a.gguf", seed=1), "b": write_tiny_lora(d / "b.gguf", seed=2, rank=2)}


def load(model: Path, adapters: dict[str, Path], parallel: int = 4) -> GGUFModel:
    cfg = ModelConfig(name="tiny", path=str(model), n_ctx=512, n_threads=1, use_mlock=False, parallel=parallel,
                      adapters=[AdapterConfig(n, str(p), 1.0) for n, p in adapters.items()])
    return load_gguf_model(cfg, read_gguf_info(model))


@pytest.fixture(scope="module")
def model(tiny_gguf: Path, loras: dict[str, Path]) -> GGUFModel:
    m = load(tiny_gguf, loras)
    yield m
    m.close()


def edge_logits(m: GGUFModel, sel: tuple) -> np.ndarray:
    n = m.native
    with m.slots.spare() as seq:
        m.cache.reset(seq)
        n.use_adapters(sel)
        n.decode(seq, m.tokenize_prompt(PROMPT), 0)
        out = np.array(n.logits())
        m.cache.reset(seq)
        n.use_adapters(())
    return out


def reference_logits(model: Path, lora: Path | None, scale: float, tokens: list[int]) -> np.ndarray:
    """llama.cpp's own computation: llama-cpp-python's Llama with the adapter on its context."""
    from llama_cpp import Llama

    kw = {"lora_path": str(lora), "lora_scale": scale} if lora else {}
    llm = Llama(str(model), n_ctx=512, n_threads=1, logits_all=True, verbose=False, **kw)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[len(tokens) - 1])
    finally:
        llm.close()


@pytest.mark.parametrize("scale", [1.0, 0.5, -1.0])
def test_the_adapted_logits_are_llama_cpps_reference(model: GGUFModel, tiny_gguf: Path,
                                                     loras: dict[str, Path], scale: float) -> None:
    tokens = model.tokenize_prompt(PROMPT)
    base = reference_logits(tiny_gguf, None, 1.0, tokens)
    want = reference_logits(tiny_gguf, loras["a"], scale, tokens)
    got = edge_logits(model, select("tiny", model.adapters, None, [{"name": "a", "scale": scale}]))
    moved = np.abs(want - base).max()
    assert moved > 0.3  # the adapter really changes the output
    # same computation; the contexts differ only in flash attention's summation order
    assert np.abs(got - want).max() < moved / 100, (np.abs(got - want).max(), moved)
    assert np.abs(edge_logits(model, ()) - base).max() < moved / 100


def test_scale_zero_is_the_base_model(model: GGUFModel) -> None:
    base = edge_logits(model, ())
    assert select("tiny", model.adapters, None, [{"name": "a", "scale": 0}]) == ()  # shares the base's batches
    assert np.array_equal(edge_logits(model, ((model.adapters["a"], 0.0),)), base)  # and in llama.cpp too
    assert not np.array_equal(edge_logits(model, ((model.adapters["a"], 1.0),)), base)


def test_a_request_names_adapters_by_suffix_name_or_id_and_unknown_ones_are_400s(model: GGUFModel) -> None:
    a, b = model.adapters["a"], model.adapters["b"]
    assert select("tiny", model.adapters, "a", None) == ((a, 1.0),)
    assert select("tiny", model.adapters, None, [{"id": 1, "scale": 0.25}]) == ((b, 0.25),)
    assert select("tiny", model.adapters, "b", [{"name": "a", "scale": 2}]) == ((a, 2.0), (b, 1.0))
    for suffix, lora, names in (("nope", None, "'nope'"), (None, [{"name": "zz"}], "'zz'"),
                                (None, [{"id": 5}], "5"), (None, [{"name": "a", "scale": "x"}], "'x'"),
                                (None, [{"name": "a", "id": 0}], "one of them"), (None, {"a": 1}, "a list")):
        with pytest.raises(RequestError) as err:
            select("tiny", model.adapters, suffix, lora)
        assert err.value.status == 400 and names in str(err.value)


def _job(m: GGUFModel, sel: tuple, n: int = 16) -> Job:
    return Job(tokens=m.tokenize_prompt(PROMPT), params=GenParams(max_tokens=n, temperature=0), adapters=sel)


def _alone(m: GGUFModel, sel: tuple) -> str:
    return "".join(p.text for p in m.generate(Job(tokens=m.tokenize_prompt(PROMPT), cache_prompt=False, remember=False,
                                                  params=GenParams(max_tokens=16, temperature=0), adapters=sel)))


def test_mixed_selections_in_one_scheduler_give_what_each_gives_alone(model: GGUFModel) -> None:
    """Base, a, b and a+b at once, twice each (8 sequences in 4 slots): each gets its own
    adapters' greedy text, which differ from one another."""
    sels = [(), select("tiny", model.adapters, "a", None), select("tiny", model.adapters, "b", None),
            select("tiny", model.adapters, None, [{"name": "a"}, {"name": "b", "scale": 0.5}])]
    want = [_alone(model, s) for s in sels]
    assert len(set(want)) == len(want)
    slots = model.slots
    jobs = [_job(model, s) for s in sels * 2]
    sinks = [Collect() for _ in jobs]
    pending = list(zip(jobs, sinks))
    while pending or slots.busy:
        while pending and slots.fits(pending[0][0]):
            slots.start(*pending.pop(0))
        slots.step()
    assert [s.text for s in sinks] == want * 2
    assert all(s.ended is None for s in sinks)
    # base again after adapted sequences: nothing of theirs was reused from the cache
    assert _alone(model, ()) == want[0]


def test_selections_take_the_steps_in_turns(model: GGUFModel) -> None:
    """Three selections with work: every three consecutive steps hold each of them once, and
    the base selection's sequences are not held back by the adapted ones' number."""
    slots = model.slots
    sels = [(), select("tiny", model.adapters, "a", None), select("tiny", model.adapters, "b", None)]
    jobs = [_job(model, sels[0], 12), _job(model, sels[1], 12), _job(model, sels[1], 12), _job(model, sels[2], 12)]
    for j in jobs:
        slots.start(j, Collect())
    turns = []
    while slots.step():
        turns.append(tuple(sorted({s.selection for s in slots.active if s.stepped} or {slots.turns.last})))
    firsts = [t for t in turns[:9]]
    assert len({t for t in firsts[:3]}) == 3 and firsts[:3] == firsts[3:6] == firsts[6:9], turns[:9]
    assert all(j.completion_tokens == 12 for j in jobs)
    assert slots.busy == 0


LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat all day long."


def _run(m: GGUFModel) -> None:
    steps = 0
    while m.slots.step():
        steps += 1
        assert steps < 10_000


def test_no_cells_cross_between_a_selection_and_the_base(model: GGUFModel) -> None:
    """A prompt longer than the prompt cache's reuse threshold, adapted and base at once: neither
    reuses the other's cells (no sharing while both run, no saved state of the adapted one after),
    each answers as it does alone; an adapted sequence's slot is emptied when it ends, and the
    next adapted prompt takes an empty slot, not the one the base's prefix is cached in."""
    tokens = model.tokenize_prompt(LONG)
    assert len(tokens) > 2 * MIN_REUSE
    slots, a = model.slots, select("tiny", model.adapters, "a", None)
    want = {sel: "".join(p.text for p in model.generate(Job(tokens=list(tokens), cache_prompt=False, remember=False,
                                                             params=GenParams(max_tokens=8, temperature=0),
                                                             adapters=sel)))
            for sel in ((), a)}
    slots.forget()
    model.cache.clear()
    adapted, base = [Job(tokens=list(tokens), params=GenParams(max_tokens=8, temperature=0), adapters=sel)
                     for sel in (a, ())]
    sinks = [Collect(), Collect()]
    slots.start(adapted, sinks[0])
    slots.step()  # its prompt is in its cells before the base one comes
    slots.start(base, sinks[1])
    _run(model)
    assert [s.text for s in sinks] == [want[a], want[()]] and adapted.cached_tokens == base.cached_tokens == 0
    assert not model.cache.private and not model.cache.entries  # nothing saved: no state of the adapted cells
    cached = [s.id for s in slots.slots if model.cache.live(s.id)]
    assert len(cached) == 1 and model.cache.live(cached[0])[:len(tokens)] == tokens  # the base's alone
    again = Job(tokens=list(tokens), params=GenParams(max_tokens=8, temperature=0), adapters=a)
    sink = Collect()
    slots.start(again, sink)  # lands in an empty slot: the base's prefix stays where it is
    _run(model)
    assert sink.text == want[a] and again.cached_tokens == 0
    assert [s.id for s in slots.slots if model.cache.live(s.id)] == cached


def test_an_adapted_sequence_suspended_for_room_resumes_with_its_adapters(tiny_gguf: Path,
                                                                         loras: dict[str, Path]) -> None:
    """Two long answers that cannot both fit a 128-token context, the youngest adapted: it gives
    its cells up (no state of them saved: they are its adapters'), waits, and is computed again
    with its adapters once the other ended. Every token of each answer is the greedy choice
    under its own selection (teacher-forced, kit.slots.greedy_gap), not under the other."""
    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=128, n_threads=1, use_mlock=False, parallel=4,
                      adapters=[AdapterConfig("a", str(loras["a"]), 1.0)])
    m = load_gguf_model(cfg, read_gguf_info(tiny_gguf))
    try:
        a, eos, n_ctx = select("tiny", m.adapters, "a", None), m.native.eos, m.native.n_ctx
        first, second = m.tokenize_prompt("Hello world"), m.tokenize_prompt("One two three four five six")
        jobs = [Job(tokens=t, adapters=sel, params=GenParams(max_tokens=n, temperature=0, logit_bias=((eos, -100.0),)))
                for t, sel, n in ((first, (), n_ctx - len(first) - 1), (second, a, n_ctx // 2))]
        sinks, seqs = [Collect(), Collect()], []
        for j, s in zip(jobs, sinks):
            m.slots.start(j, s)
            seqs.append(m.slots.active[-1])
        _run(m)
        assert [s.ended for s in sinks] == [None, None] and seqs[1].suspensions >= 1 and seqs[0].suspensions == 0
        for j, seq, sel, other in zip(jobs, seqs, ((), a), (a, ())):
            assert len(seq.out.tokens) == j.params.max_tokens
            assert greedy_gap(m, j.tokens + seq.out.tokens, len(j.tokens), (eos,), sel) < 1e-3
            assert greedy_gap(m, j.tokens + seq.out.tokens, len(j.tokens), (eos,), other) > 1e-2
        adapted = jobs[1].tokens
        assert not any(e.tokens[:len(adapted)] == adapted for e in m.cache.entries.values())
        assert m.slots.pending == 0 and not m.cache.private
    finally:
        m.close()


def test_a_damaged_or_mismatched_adapter_is_refused_naming_file_and_field(tiny_gguf: Path, tmp_path: Path,
                                                                            loras: dict[str, Path]) -> None:
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(loras["a"].read_bytes()[:-4000])
    other = write_tiny_lora(tmp_path / "other.gguf", n_embd=32)
    arch = write_tiny_lora(tmp_path / "arch.gguf", arch="gemma3")
    for path, says in ((trunc, "truncated"), (other, "llama.cpp refused"), (arch, "general.architecture"),
                       (tmp_path / "missing.gguf", "does not exist"), (tiny_gguf, "general.type")):
        with pytest.raises(ModelError) as err:
            load(tiny_gguf, {"x": path}).close()
        assert err.value.exit_code == EX_DATAERR
        assert str(path) in str(err.value) and "models[0].adapters[0].path" in str(err.value), err.value
        assert says in str(err.value), err.value


def test_the_config_checks_each_adapter_field(tmp_path: Path) -> None:
    head = '[[models]]\nname = "m"\npath = "m.gguf"\n'
    for table, field in (('name = "a b"\npath = "x.gguf"', "models[0].adapters[0].name"),
                         ('name = "a"\npath = ""', "models[0].adapters[0].path"),
                         ('name = "a"\npath = "x.gguf"\nscale = 1000', "models[0].adapters[0].scale"),
                         ('name = "a"', "models[0].adapters[0].path")):
        with pytest.raises(ConfigError) as err:
            parse_config(head + "[[models.adapters]]\n" + table + "\n", source="edge.toml", base_dir=tmp_path)
        assert field in str(err.value) and "edge.toml" in str(err.value), err.value
    twice = head + '[[models.adapters]]\nname = "a"\npath = "x.gguf"\n' * 2
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapters\[1\]\.name.*duplicate"):
        parse_config(twice, source="edge.toml", base_dir=tmp_path)
    cfg = parse_config(head + '[[models.adapters]]\nname = "a"\npath = "x.gguf"\n', base_dir=tmp_path)
    assert cfg.models[0].adapters[0] == AdapterConfig("a", str(tmp_path / "x.gguf"), 1.0)
