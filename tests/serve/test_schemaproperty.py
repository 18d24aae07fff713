"""Valid by construction: for random and adversarial schemas (every enforced keyword of KEYWORDS,
nested, through `$ref`s), random complete outputs walked through the compiled grammar by
llama.cpp's own grammar sampler (tests/kit/grammarwalk.py) are JSON that the `jsonschema`
validator (Draft 2020-12, formats checked) accepts: over 10,000 (schema, output) pairs, none
invalid. A schema edge refuses is a 400 naming the field and the keyword's path."""

from __future__ import annotations

import json
import random

import pytest

from edge.errors import RequestError
from edge.model.llm import GGUFModel
from edge.serve.schema import KEYWORDS, schema_grammar
from kit.grammarwalk import Walker
from kit.schemagen import SchemaGen

jsonschema = pytest.importorskip("jsonschema")
P = "response_format.json_schema"
SCHEMAS, WALKS = 350, 32  # 11,200 walks, of which a few run past the byte bound


def invalid(schema: dict, text: bytes) -> str | None:
    """Why `text` is not a valid instance of `schema` (None: it is)."""
    cls = jsonschema.Draft202012Validator
    try:
        value = json.loads(text.decode("utf-8"))
    except ValueError as exc:
        return f"not JSON: {exc}"
    errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return errors[0].message if errors else None


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
    pairs, bad, refused, kinds = 0, [], 0, set()
    for _ in range(SCHEMAS):
        schema = gen.schema()
        try:
            outs = outputs(model, walker, schema, rng, WALKS)
        except RequestError as exc:
            assert exc.param == P and str(exc).startswith(P), exc
            refused += 1
            continue
        kinds |= {k for k in json.dumps(schema).split('"') if k in KEYWORDS}
        pairs += len(outs)
        bad += [(schema, o, why) for o in outs if (why := invalid(schema, o))]
    assert bad == [], bad[:3]
    assert pairs >= 10_000 and refused < SCHEMAS // 5, (pairs, refused)
    enforced = {k for k, (status, _) in KEYWORDS.items() if status == "enforced"} - {"definitions"}
    assert enforced <= kinds, enforced - kinds  # every enforced keyword was in a schema walked


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
