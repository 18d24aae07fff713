"""Grammars compiled on the grammar thread (edge.model.grammar): a nesting that overflows a
default 8 MiB thread stack compiles without killing the process, a grammar llama.cpp refuses is a
400 with one summary line instead of the whole grammar on stderr, one compile serves every job of
a request, and llama.cpp's log is capped and rate-limited (edge.model.nativelog)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.errors import RequestError
from edge.model import nativelog
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.nativelog import RateLimiter, captured_stderr

DEEP = 20_000  # measured: llama.cpp's parser overflows an 8 MiB stack near 18,700 nested groups


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> GGUFModel:
    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=256, n_batch=64, n_threads=1, use_mlock=False)
    m = load_gguf_model(cfg, read_gguf_info(tiny_gguf))
    yield m
    m.close()


def test_a_nesting_past_the_default_stack_compiles_on_the_grammar_thread(model: GGUFModel) -> None:
    gbnf = "root ::= " + '("a" ' * DEEP + ")" * DEEP
    compiled = model.compile_grammar(gbnf, "response_format.json_schema")  # on the worker: SIGSEGV
    assert compiled.sampler and compiled.size == len(gbnf)
    clone = compiled.clone()
    assert clone
    model.native.lib.llama_sampler_free(clone)
    compiled.close()


def test_a_refused_grammar_is_a_400_and_one_line_not_the_grammar(model: GGUFModel, capfd: pytest.CaptureFixture,
                                                                   caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.model import grammar

    monkeypatch.setattr(grammar, "_WARNINGS", RateLimiter(burst=2, window_s=3600))
    gbnf = 'root ::= "a" undefined-rule\n' + "".join(f'filler{i} ::= "{"x" * 100}"\n' for i in range(2000))
    with caplog.at_level(logging.WARNING, "edge"), pytest.raises(RequestError) as err:
        model.compile_grammar(gbnf, "response_format.json_schema")
    assert err.value.param == "response_format.json_schema" and "Undefined rule" in str(err.value)
    out, errout = capfd.readouterr()
    assert "filler" not in out + errout  # llama.cpp's parser printed all 200 KB of it before
    lines = [r.getMessage() for r in caplog.records if "grammar for response_format.json_schema" in r.getMessage()]
    assert len(lines) == 1 and f"bytes of output" in lines[0] and len(lines[0]) < 600
    for _ in range(5):  # a flood of them: two lines a window
        with pytest.raises(RequestError):
            model.compile_grammar(gbnf, "response_format.json_schema")
    lines = [r.getMessage() for r in caplog.records if "grammar for response_format.json_schema" in r.getMessage()]
    assert len(lines) == 2


def test_one_compiled_grammar_serves_every_job_of_a_request(model: GGUFModel) -> None:
    compiled = model.compile_grammar('root ::= "yes" | "no"', "response_format")
    texts = []
    for seed in (1, 2, 3):
        job = Job(tokens=model.tokenize_prompt("Answer:"), params=GenParams(max_tokens=8, seed=seed, grammar=compiled))
        texts.append("".join(p.text for p in model.generate(job)))
    assert set(texts) <= {"yes", "no"} and texts
    compiled.close()


def test_captured_stderr_takes_what_c_prints_and_gives_stderr_back(capfd: pytest.CaptureFixture) -> None:
    import ctypes

    libc = ctypes.CDLL(None)
    stderr = ctypes.c_void_p.in_dll(libc, "stderr")
    with captured_stderr() as got:
        libc.fputs(b"inside\n", stderr)
    libc.fputs(b"outside\n", stderr)
    libc.fflush(stderr)
    assert got.text == b"inside\n" and capfd.readouterr().err == "outside\n"


def test_the_rate_limiter_holds_back_a_burst_and_says_how_many() -> None:
    now = [0.0]
    limiter = RateLimiter(burst=2, window_s=10, clock=lambda: now[0])
    assert [limiter.allow(b"k") for _ in range(5)] == [(True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
    assert limiter.allow(b"other") == (True, 0)
    now[0] = 10.0
    assert limiter.allow(b"k") == (True, 3)


def test_a_native_log_line_is_cut_and_repeats_are_held_back(caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nativelog, "_LIMITER", RateLimiter(burst=3, window_s=3600))
    with caplog.at_level(logging.ERROR, "edge.native"):
        for i in range(50):
            nativelog._on_log(3, b"parse: error parsing grammar: " + str(i).encode() + b" " + b"x" * 5000, None)
        nativelog._on_log(2, b"a warning", None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(len(line) < 600 and "bytes of output" in line for line in lines)


def test_a_compile_past_its_deadline_is_a_400_and_is_freed_when_it_ends(model: GGUFModel) -> None:
    import threading

    from edge.model import grammar

    gate, freed = threading.Event(), threading.Event()
    grammar._COMPILER.submit(gate.wait)  # the grammar thread is busy: the next compile waits behind it
    lib = model.native.lib

    class ObservedLlama:  # the real llama.cpp bindings; only its llama_sampler_free is watched
        def __getattr__(self, name: str) -> object:
            return getattr(lib, name)

        def llama_sampler_free(self, sampler: object) -> None:
            lib.llama_sampler_free(sampler)
            freed.set()

    with pytest.raises(RequestError, match="took more than 0.05 s to compile"):
        grammar.compile_grammar(ObservedLlama(), model.native.vocab, 'root ::= "a"', "response_format", timeout_s=0.05)
    gate.set()
    assert freed.wait(30)


def test_gbnf_text_in_a_job_is_compiled_on_the_grammar_thread_too(model: GGUFModel) -> None:
    gbnf = 'root ::= "x" ' + '("a" ' * DEEP + ")" * DEEP  # past the worker's stack, if it parsed it
    job = Job(tokens=model.tokenize_prompt("Answer:"), params=GenParams(max_tokens=3, temperature=0, grammar=gbnf))
    assert "".join(p.text for p in model.generate(job)) == "xaa"
