"""Valid by construction: for random and adversarial schemas (every enforced keyword of KEYWORDS,
nested, through `$ref`s; `allOf` and `$ref` with keywords beside it, `oneOf` without types or with
values equal as JSON, NaN and the infinities, `enum` beside `const`: kit.schemagen), random
complete outputs walked through the compiled grammar by llama.cpp's own grammar sampler and
edge's guard after it, every byte token offered at every position (tests/kit/grammarwalk.py),
are strict UTF-8, strict JSON (no NaN/Infinity, no key twice) and valid by the `jsonschema`
validator (Draft 2020-12, formats checked): at least 20,000 (schema, output) pairs, none
invalid (EDGE_SCHEMA_PAIRS=200000 for a bigger run). A schema edge refuses is a 400 naming the
field and the keyword's path; one holding NaN or an infinity is always refused."""

from __future__ import annotations

import json
import os
import random

import pytest

from edge.errors import RequestError
from edge.model.llm import GGUFModel
from edge.serve.schema import KEYWORDS, schema_grammar
from kit.grammarwalk import Walker
from kit.schemacheck import invalid
from kit.schemagen import SchemaGen

pytest.importorskip("jsonschema")
P = "response_format.json_schema"
PAIRS = int(os.environ.get("EDGE_SCHEMA_PAIRS", "20000"))  # (schema, output) pairs to check
WALKS = 32  # per schema; a few run past the byte bound
# issue 56's constructs, each accepted (and walked) in some schemas and refused in others
BOTH_WAYS = ("closed-ref", "ref-siblings", "allOf-array", "allOf-object", "allOf-bounds", "oneOf-typeless",
             "oneOf-values", "oneOf-discriminated", "enum-const")


def outputs(model: GGUFModel, walker: Walker, schema: dict, rng: random.Random, n: int,
            max_bytes: int = 300) -> list[bytes]:
    compiled = model.compile_grammar(schema_grammar(schema, P), P)
    try:
        return [o for o in (walker.walk(compiled, rng, max_bytes) for _ in range(n)) if o is not None]
    finally:
        compiled.close()


def test_every_walked_output_of_random_schemas_is_valid(grammar_walk: tuple[GGUFModel, Walker]) -> None:
    model, walker = grammar_walk
    rng, gen = random.Random(39), SchemaGen(random.Random(3939))
    pairs, bad, schemas, refused, kinds = 0, [], 0, 0, set()
    accepted_kinds, refused_kinds = set(), set()
    while pairs < PAIRS and schemas < PAIRS:  # (the second bound: a generator that stopped working)
        schema, schemas = gen.schema(), schemas + 1
        text = json.dumps(schema)
        try:
            outs = outputs(model, walker, schema, rng, WALKS)
        except RequestError as exc:
            assert exc.param == P and str(exc).startswith(P), exc
            refused, refused_kinds = refused + 1, refused_kinds | gen.used
            continue
        assert "NaN" not in text and "Infinity" not in text, text  # never a grammar: a 400
        kinds |= {k for k in text.split('"') if k in KEYWORDS}
        accepted_kinds |= gen.used
        pairs += len(outs)
        bad += [(schema, o, why) for o in outs if (why := invalid(schema, o))]
    assert bad == [], bad[:3]
    assert pairs >= PAIRS and refused < schemas // 3, (pairs, schemas, refused)
    enforced = {k for k, (status, _) in KEYWORDS.items() if status == "enforced"} - {"definitions"}
    assert enforced <= kinds, enforced - kinds  # every enforced keyword was in a schema walked
    assert set(BOTH_WAYS) <= accepted_kinds & refused_kinds, set(BOTH_WAYS) - (accepted_kinds & refused_kinds)
    assert "nonfinite" in refused_kinds


def test_a_refused_keyword_anywhere_in_a_random_schema_is_a_400_naming_it() -> None:
    gen, rng = SchemaGen(random.Random(7)), random.Random(8)
    refused = [k for k, (status, _) in KEYWORDS.items() if status == "refused"]
    for i in range(200):
        schema, keyword = gen.schema(), refused[i % len(refused)]
        spot, path = schema, ""
        while rng.random() < 0.7 and isinstance(spot.get("properties"), dict) and spot["properties"]:
            name = rng.choice(sorted(spot["properties"]))
            if not isinstance(spot["properties"][name], dict):
                break
            spot, path = spot["properties"][name], f"{path}.properties.{name}"
        spot[keyword] = 1
        with pytest.raises(RequestError) as err:
            schema_grammar(schema, P)
        assert err.value.param == P and f"{P}{path}.{keyword}: " in str(err.value), (schema, str(err.value))


def test_walked_strings_of_random_patterns_match_them(grammar_walk: tuple[GGUFModel, Walker]) -> None:
    """Patterns read by Python's re parser: every output is a JSON string `re.search` matches, or
    the pattern is a 400 (a repeated part that can match nothing, chiefly)."""
    import re

    from kit.schemagen import random_pattern

    model, walker = grammar_walk
    rng, matched, refused = random.Random(11), 0, 0
    for _ in range(100):
        pattern = random_pattern(rng)
        try:
            outs = outputs(model, walker, {"type": "string", "pattern": pattern}, rng, 12, max_bytes=120)
        except RequestError as exc:
            assert f"{P}.pattern: " in str(exc), (pattern, str(exc))
            refused += 1
            continue
        for out in outs:
            text = json.loads(out.decode("utf-8"))
            assert re.search(pattern, text), (pattern, out)
            matched += 1
    assert matched >= 900 and refused < 30, (matched, refused)
