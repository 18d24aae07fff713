"""JSON schema -> grammar: every keyword enforced, refused (naming it) or ignored as KEYWORDS says,
the grammar's bounds in size (GRAMMAR_LIMITS) and in work (MAX_STACKS: the nested-anyOf family
and the patterns of issue 39 are 400s before anything compiles)."""

from __future__ import annotations

import re

import pytest

from edge.errors import RequestError
from edge.serve.schema import GRAMMAR_LIMITS, KEYWORDS, MAX_STACKS, measure_gbnf, schema_grammar
from kit.schemagen import nested_any_of

P = "response_format.json_schema"


def refused(schema: object) -> str:
    with pytest.raises(RequestError) as err:
        schema_grammar(schema, P)
    assert err.value.param == P
    return str(err.value)



def test_integer_bounds_become_the_grammar_of_the_range() -> None:
    gbnf = schema_grammar({"type": "integer", "minimum": 0, "maximum": 120}, P)
    rule = re.search(r"^root ::= (.*)$", gbnf, re.M)[1]
    rx = re.compile(rule.replace('" "', "").replace('"', "").replace(" | ", "|").replace(" ", ""))
    assert [n for n in range(-50, 500) if rx.fullmatch(str(n))] == list(range(0, 121))


@pytest.mark.parametrize("keyword, value", [(k, 1) for k, (s, _) in KEYWORDS.items() if s == "refused"])
def test_every_refused_keyword_is_a_400_naming_it(keyword: str, value: object) -> None:
    assert f"{P}.properties.x.{keyword}: " in refused({"type": "object", "properties": {"x": {keyword: value}}})


@pytest.mark.parametrize("schema, where", [
    ({"type": "number", "minimum": 0}, ".minimum: minimum is enforced only on"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, ".minLength: 'minLength' is not enforced beside pattern"),
    ({"type": "string", "maxLength": 10**9}, ".maxLength: must be an integer from 0 to 10000"),
    ({"type": "string", "pattern": "^a{,20000}$"}, ".pattern: asks for 20000 copies"),
    ({"nope": 1}, ".nope: 'nope' is not a JSON Schema keyword"),
    ({"allOf": [{"type": "string", "pattern": "^a+$"}, {"minLength": 1}, {"pattern": "^b+$"}]},
     ".allOf[2].pattern: allOf sets pattern twice"),
    ({"enum": [f"value-{i:06d}" for i in range(100_000)]}, ".enum: its values' JSON is 1400000 bytes"),
])
def test_what_the_grammar_would_not_enforce_is_refused_naming_the_keyword(schema: dict, where: str) -> None:
    assert f"{P}{where}" in refused(schema)


def test_annotations_are_accepted_and_change_nothing() -> None:
    plain = schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}}}, P)
    noted = schema_grammar({"type": "object", "title": "t", "description": "d", "$schema": "x",
                            "properties": {"a": {"type": "boolean", "default": True, "examples": [1]}}}, P)
    assert plain == noted


@pytest.mark.parametrize("schema, what", [
    ({"anyOf": [{"const": f"v{i}"} for i in range(GRAMMAR_LIMITS.widest + 1)]},
     f"alternation of {GRAMMAR_LIMITS.widest + 1} choices"),
    ({"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(GRAMMAR_LIMITS.widest + 1)) + ")$"},
     f"alternation of {GRAMMAR_LIMITS.widest + 1} choices"),
    ({"type": "object", "properties": {f"p{i:05d}": {"const": "x" * 60} for i in range(2000)},
      "required": [f"p{i:05d}" for i in range(2000)]}, "bytes, more than"),
    ({"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(129)}}, "more than 128 optional"),
])
def test_a_grammar_past_its_size_bounds_is_a_400(schema: dict, what: str) -> None:
    assert what in refused(schema)


@pytest.mark.parametrize("schema", [
    nested_any_of(1, 256), nested_any_of(2, 256), nested_any_of(3, 256), nested_any_of(3, 64), nested_any_of(2, 16),
    nested_any_of(6, 4),
    {"anyOf": [{"$ref": "#"}, {"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}}]},
    {"type": "string", "pattern": "^(a|a)(a|a)(a|a)(a|a)(a|a)(a|a)(a|a)(a|a)(a|a)(a|a)(a+|b){0,300}$"},
    {"type": "string", "pattern": "^(a+){0,300}$"},
])
def test_a_grammar_that_can_keep_too_many_stacks_is_a_400(schema: dict) -> None:
    message = refused(schema)
    assert f"more than {MAX_STACKS} grammar stacks" in message or "cannot" in message or "itself" in message, message


@pytest.mark.parametrize("schema", [
    nested_any_of(1, 128), nested_any_of(2, 8), nested_any_of(3, 4), nested_any_of(8, 1),
    {"$defs": {"t": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"$ref": "#/$defs/t"}}}]}},
     "$ref": "#/$defs/t"},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(128)}},
])
def test_schemas_within_the_work_bound_are_accepted(schema: dict) -> None:
    assert schema_grammar(schema, P)


def test_measure_skips_strings_classes_and_comments() -> None:
    size = measure_gbnf('root ::= ("(" | [(|] | "a" ("b" | "c" | "d")) # ( | |\nx ::= "|" | "|"\n')
    assert (size.nesting, size.widest) == (2, 3)
