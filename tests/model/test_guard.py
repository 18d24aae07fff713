"""The guard after the grammar (edge.model.guard): strict UTF-8 as Unicode's table has it (checked
against Python's strict decoder), the text the grammar read (control tokens, NUL bytes), no key
twice in a JSON object (keys compared decoded); and generation under a schema on the tiny GGUF
with `logit_bias` pushing what llama.cpp's grammar lets through: the surrogate `ED A0 A0` as one
character of `{"maxLength": 1}`, overlong forms, the BOS token's name inside a string, a key
written twice. Every output is strict UTF-8 JSON valid against its schema, lazily and with the
grammar over every candidate (the reference), greedy and sampled."""

from __future__ import annotations

import itertools
import random

import pytest

from edge.model.generate import GenParams, Job
from edge.model.guard import OutputGuard, utf8_after
from edge.serve.schema import schema_grammar
from kit.schemacheck import invalid


def _proper_prefixes() -> set[bytes]:
    """The starts of every character's UTF-8 (without the whole): what a text may end with."""
    out = set()
    for cp in itertools.chain(range(0x80, 0xD800), range(0xE000, 0x110000)):
        enc = chr(cp).encode("utf-8")
        out.update(enc[:k] for k in range(1, len(enc)))
    return out


def well_formed_prefix(b: bytes, starts: set[bytes]) -> bool:
    """Python's strict decoder takes b whole, or b's beginning and the start of a character after it."""
    for k in range(0, min(3, len(b)) + 1):
        head, tail = b[:len(b) - k], b[len(b) - k:]
        try:
            head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tail or tail in starts:
            return True
    return False


def test_utf8_is_what_a_strict_decoder_takes() -> None:
    rng = random.Random(8)
    samples = [bytes(p) for n in (1, 2) for p in itertools.product(range(256), repeat=n)]
    samples += [bytes([rng.choice([0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xC2, 0x80])] + rng.choices(range(0x70, 0xC8), k=k))
                for k in (2, 3, 4) for _ in range(20_000)]
    starts = _proper_prefixes()
    wrong = [b for b in samples if (utf8_after(0, 0x80, 0xBF, b) is not None) != well_formed_prefix(b, starts)]
    assert wrong == [], [w.hex() for w in wrong[:5]]
    assert utf8_after(0, 0x80, 0xBF, b"\xed\xa0") is None and utf8_after(0, 0x80, 0xBF, b"\xc0\xaf") is None
    assert utf8_after(0, 0x80, 0xBF, b"\xf0\x9f\x98") == (1, 0x80, 0xBF)  # a character not finished yet


def feed(walker, text: bytes) -> int | None:  # noqa: ANN001
    """Where the guard first says no to `text` fed byte by byte (a byte token each); None: never."""
    guard = OutputGuard(walker.table, json=True)
    for i, b in enumerate(text):
        tok = walker.byte_tok[b]
        if not guard.allows(tok):
            return i
        guard.accept(tok)
    return None


@pytest.mark.parametrize("text, refused_at", [
    (b'{"a": 1, "a": 2}', 11), (b'{"a/": 1, "a\\/": 2}', 14), (b'{"a\\"": 1, "a\\"": 2}', 15),
    (b'{"\\u0061": 1, "a": 2}', 16), (b'{"": {"": 1}, "": 2}', 15), (b'{"k": [{"a": 1, "b": 2, "a": 3}]}', 26),
    (b'{"a": {"a": 1}}', None), (b'[{"a": 1}, {"a": 1}]', None), (b'{"a": "a", "b": "a", "c": ["a", "a"]}', None),
    (b'{"x\\n": 1, "x\\u000a": 2}', 19), ('{"名": 1, "名": 2}'.encode(), 15),
])
def test_a_key_twice_in_one_object_is_turned_down_at_its_closing_quote(grammar_walk: tuple, text: bytes,
                                                                        refused_at: int | None) -> None:
    assert feed(grammar_walk[1], text) == refused_at


def test_hidden_tokens_and_an_unfinished_character_are_turned_down(grammar_walk: tuple) -> None:
    m, walker = grammar_walk
    guard = OutputGuard(walker.table, json=False)
    assert not guard.allows(m.native.bos)  # its name reaches the grammar, nothing reaches the client
    guard.accept(walker.byte_tok[0xF0])
    assert not guard.allows(m.native.eos) and not guard.allows(walker.byte_tok[0x41])
    assert not guard.allows(walker.byte_tok[0x8F]) and guard.allows(walker.byte_tok[0x9F])  # F0 needs 90..BF
    assert feed(walker, b"\x00") == 0 and feed(walker, b"a\xc0") == 1 and feed(walker, b"\xed\xa0") == 1


def generated(m, schema: dict, bias: dict[int, float], temperature: float, seed: int, lazy: bool,  # noqa: ANN001
              monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, str | None, int]:
    """(the output's bytes, its finish, tokens the guard turned down) of one generation."""
    import edge.model.generate as generate_mod

    chains = []
    original = generate_mod.SamplerChain

    def made(native, p):  # noqa: ANN001, ANN202
        chains.append(original(native, p, lazy=lazy))
        return chains[-1]

    monkeypatch.setattr(generate_mod, "SamplerChain", made)
    compiled = m.compile_grammar(schema_grammar(schema, "x"), "x", json=True)
    job = Job(tokens=m.tokenize_prompt("Hello"), params=GenParams(
        max_tokens=48, temperature=temperature, seed=seed, grammar=compiled, logit_bias=tuple(bias.items())),
        cache_prompt=False)
    pieces = list(m.generate(job))
    compiled.close()
    monkeypatch.setattr(generate_mod, "SamplerChain", original)
    text = "".join(p.text for p in pieces)
    assert "\ufffd" not in text, text  # no byte the client's decoder had to replace
    return text.encode("utf-8"), pieces[-1].finish_reason, chains[0]._g.guarded


PUSHES = [  # (schema, the bytes logit_bias pushes: llama.cpp's grammar takes each where it leads)
    ({"type": "string", "maxLength": 1}, {0xED: 100, 0xA0: 90}),  # a surrogate as one character
    ({"type": "string", "maxLength": 3}, {0xC0: 100, 0xAF: 90, 0xF5: 80, 0xC3: 70, 0x41: 60}),  # overlong, past U+10FFFF
    ({"type": "string", "minLength": 3, "maxLength": 3}, {"bos": 100}),  # `<s>`: 3 characters to the grammar
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {0x22: 6, 0x3A: 4, 0x31: 3, 0x2C: 2}),
    ({"type": "object"}, {0x22: 6, 0x3A: 4, 0x31: 3, 0x2C: 2, 0x7D: -100}),
]


@pytest.mark.parametrize("schema, push", PUSHES)
def test_pushed_tokens_never_make_an_invalid_output(grammar_walk: tuple, monkeypatch: pytest.MonkeyPatch,
                                                    schema: dict, push: dict) -> None:
    m, walker = grammar_walk
    bias = {(m.native.bos if b == "bos" else walker.byte_tok[b]): v for b, v in push.items()}
    turned_down = 0
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        texts = {}
        for lazy in (True, False):
            text, finish, guarded = generated(m, schema, bias, temperature, seed, lazy, monkeypatch)
            turned_down += guarded
            if finish == "stop":
                assert invalid(schema, text) is None, (text, invalid(schema, text))
            else:  # cut by max_tokens: strict UTF-8 all the same (a character never cut in two)
                text.decode("utf-8")
            texts[lazy] = text
        if temperature == 0:
            assert texts[True] == texts[False]  # greedy: the grammar and guard over every candidate, the same
    assert turned_down > 0  # the push reached the guard: without it the output was invalid
