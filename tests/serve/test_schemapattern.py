"""A schema `pattern` read as llama-cpp-python's converter reads it, against `re`'s own parser:
a fuzzer over quantifier syntax ({n}, {n,}, {,m}, {n,m}, {,}, signs, underscores, spaces,
leading zeros, min > max, nested groups, alternation), and the forms that crashed the service."""

from __future__ import annotations

import random
import re
import threading

import pytest

from edge.errors import RequestError
from edge.serve.jsonschema import schema_grammar
from edge.serve.schemapattern import MAX_REPEAT, Repeat, read_pattern

try:  # 3.11+
    import re._constants as C
    import re._parser as sre
except ImportError:  # 3.10
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as sre  # type: ignore[no-redef]

_REPEATS = {C.MAX_REPEAT, C.MIN_REPEAT} | ({C.POSSESSIVE_REPEAT} if hasattr(C, "POSSESSIVE_REPEAT") else set())
COUNTS = [0, 1, 2, 3, 5, 10, 99, 100, 1000, 9999, 10_000, 10_001, 20_000, 200_000]


def re_reading(pattern: str) -> tuple[list[Repeat], int, bool]:
    """re's repetitions (pre-order), the most copies of one atom they make, and whether re reads
    a `{` as a literal character somewhere (a quantifier it does not know)."""
    repeats: list[Repeat] = []
    literal_brace = False

    def walk(sub) -> int:  # the most copies inside `sub`
        nonlocal literal_brace
        most = 1
        for op, av in sub:
            if op in _REPEATS:
                lo, hi, inner = av
                repeats.append(Repeat(lo, None if hi == C.MAXREPEAT else hi))
                n = walk(inner)
                most = max(most, n * max(1, lo if hi == C.MAXREPEAT else hi))
            elif op == C.SUBPATTERN:
                most = max(most, walk(av[-1]))
            elif op == C.BRANCH:
                most = max([most] + [walk(b) for b in av[1]])
            elif op == C.LITERAL and av == ord("{"):
                literal_brace = True
        return most

    return repeats, walk(sre.parse(pattern)), literal_brace


def quantifier(rng: random.Random) -> str:
    n, m = rng.choice(COUNTS), rng.choice(COUNTS)
    return rng.choice([
        "", "", "*", "+", "?", f"{{{n}}}", f"{{{n},}}", f"{{,{m}}}", f"{{{n},{m}}}", "{,}",
        f"{{0{n}}}", f"{{{min(n, m)},{max(n, m)}}}",  # leading zero; a well-ordered range
        f"{{ {n}}}", f"{{{n} }}", f"{{+{n}}}", f"{{{n},+{m}}}", f"{{{n}, {m}}}", f"{{{n}_000}}",
        f"{{-{n}}}", "{}", f"{{{n},{m},}}",
    ])


def pattern(rng: random.Random, depth: int = 0) -> str:
    items = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.25 and depth < 3:
            inner = "|".join(pattern(rng, depth + 1) for _ in range(rng.randint(1, 2)))
            atom = f"({inner})"
        else:
            atom = rng.choice(["a", "b", ".", "[ab]", "[0-9]", "xy"])
        items.append(atom + quantifier(rng))
    return "".join(items)


def convert_within(schema: dict, seconds: float) -> str:
    """schema_grammar, failing the test if it has not ended within `seconds` (the converter
    loops forever on some patterns)."""
    out: dict = {}

    def run() -> None:
        try:
            out["gbnf"] = schema_grammar(schema, "p")
        except RequestError as exc:
            out["refused"] = str(exc)
        except BaseException as exc:  # anything else fails the test below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the conversion of {schema} did not end within {seconds} s"
    assert "error" not in out, out["error"]
    return out.get("gbnf", "")


def test_fuzzed_quantifiers_are_read_as_re_reads_them_or_refused() -> None:
    rng = random.Random(33)
    accepted = refused = 0
    for _ in range(3000):
        p = pattern(rng)
        try:
            ours = read_pattern(f"^{p}$", "p.pattern", "p")
        except RequestError as exc:
            refused += 1
            try:
                _, copies, literal_brace = re_reading(p)
            except (sre.error if hasattr(sre, "error") else C.error):
                continue  # re refuses it too (min > max, nothing to repeat)
            assert literal_brace or copies > MAX_REPEAT, (p, str(exc))
            continue
        accepted += 1
        repeats, copies, literal_brace = re_reading(p)
        assert not literal_brace, p
        assert list(ours.repeats) == repeats, p
        assert ours.copies == copies <= MAX_REPEAT, p
        convert_within({"type": "string", "pattern": f"^{p}$"}, 10)
    assert accepted > 400 and refused > 400  # both sides of the line were exercised


@pytest.mark.parametrize("p, why", [
    ("^a{,20000}$", "20000 copies"), ("^a{,200000}$", "200000 copies"),
    ("^a{0,+20000}$", "'{0,+20000}' at index 1 is not a repetition"),
    ("^a{+5}$", "not a repetition"), ("^a{20_000}$", "not a repetition"), ("^a{ 5 }$", "not a repetition"),
    ("^a{5,3}$", "the minimum is more than the maximum"),
    ("^((ab{100}){100}){100}$", "1000000 copies"),
    ("^}$", "unbalanced '}'"), ("^a]$", "unbalanced ']'"),  # the converter loops forever on these
    ("^a\\d{3}$", "\\d"), ("^(?:a)$", "'(?'"), ("^a|^b$", "anchors"), ('^a"b$', "not valid JSON"),
    ("^" + "(" * 65 + "a" + ")" * 65 + "$", "nest more than 64"), ("abc", "anchored"), ("^a\\$", "escapes nothing"),
])
def test_a_pattern_the_converter_would_misread_is_refused_naming_why(p: str, why: str) -> None:
    with pytest.raises(RequestError) as err:
        read_pattern(p, "response_format.json_schema.pattern", "response_format.json_schema")
    assert why in str(err.value) and err.value.param == "response_format.json_schema"


def test_a_pattern_within_bounds_reads_its_repeats_and_copies() -> None:
    r = read_pattern("^(a{3}b){4}[0-9]{,2}x*$", "p", "p")
    assert r.repeats == (Repeat(4, 4), Repeat(3, 3), Repeat(0, 2), Repeat(0, None)) and r.copies == 12


def test_json_safe_patterns_match_what_the_pattern_does_minus_what_json_must_escape() -> None:
    from edge.serve.schemapattern import json_safe

    rng = random.Random(7)
    alphabet = ['a', 'b', '"', '\\', '\n', '\x01', '\u00e9', '-', ' ', '~']
    atoms = [".", "[a-c]", "[^a]", "[ -~]", '[a"]', "[\\x20-\\x7E]", "[\\u00e0-\\u00ff]", "[-a]", "a", "(a|.)"]
    bad = {c for c in alphabet if c in '"\\' or ord(c) < 0x20}
    for _ in range(300):
        p = "^" + "".join(rng.choice(atoms) + rng.choice(["", "?", "*"]) for _ in range(rng.randint(1, 3))) + "$"
        read_pattern(p, "p", "p")
        safe = re.compile(json_safe(p))
        for _ in range(40):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            expect = bool(re.fullmatch(p, s)) and not bad & set(s)
            assert bool(safe.fullmatch(s)) == expect, (p, s)
