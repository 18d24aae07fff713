"""JSON schema -> grammar: every keyword enforced, refused (naming it) or ignored as KEYWORDS says,
what the converter would drop refused, the grammar's bounds (GRAMMAR_LIMITS)."""

from __future__ import annotations

import re

import pytest

from edge.errors import RequestError
from edge.serve.jsonschema import GRAMMAR_LIMITS, KEYWORDS, measure_gbnf, schema_grammar

P = "response_format.json_schema"


def refused(schema: object) -> str:
    with pytest.raises(RequestError) as err:
        schema_grammar(schema, P)
    assert err.value.param == P
    return str(err.value)


def test_integer_bounds_become_the_grammar_of_the_range() -> None:
    gbnf = schema_grammar({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                           "required": ["age"]}, P)
    rule = re.search(r"^age ::= (.*) space$", gbnf, re.M)[1]
    rx = re.compile(rule.replace('" "', "").replace('"', "").replace(" | ", "|").replace(" ", ""))
    assert [n for n in range(-50, 500) if rx.fullmatch(str(n))] == list(range(0, 121))


@pytest.mark.parametrize("keyword, value", [(k, 1) for k, (s, _) in KEYWORDS.items() if s == "refused"])
def test_every_refused_keyword_is_a_400_naming_it(keyword: str, value: object) -> None:
    assert f"{P}.properties.x.{keyword}: " in refused({"type": "object", "properties": {"x": {keyword: value}}})


@pytest.mark.parametrize("schema, where", [
    ({"type": "number", "minimum": 0}, ".minimum: minimum is enforced only on"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, ".minLength: 'minLength' is not enforced beside"),
    ({"type": "array", "minItems": 2}, ".minItems"),  # no items: the converter's primitive array
    ({"type": "object", "required": ["a"]}, ".required"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, ".required: 'b' is required but not"),
    ({"type": "string", "format": "email"}, ".format: format 'email'"),
    ({"type": "string", "maxLength": 10**9}, ".maxLength: must be an integer from 0 to 10000"),
    ({"type": "string", "pattern": "^a{,20000}$"}, ".pattern: asks for 20000 copies"),
    ({"nope": 1}, ".nope: 'nope' is not a JSON Schema keyword"),
    ({"allOf": [{"type": "string"}]}, ".allOf[0]: allOf is enforced for object schemas only"),
    ({"enum": [f"value-{i:06d}" for i in range(100_000)]}, ".enum: its values' JSON is 1400000 bytes"),
])
def test_what_the_converter_would_drop_is_refused_naming_the_keyword(schema: dict, where: str) -> None:
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
    ({"type": "string", "maxLength": GRAMMAR_LIMITS.nesting + 1}, f"nests groups {GRAMMAR_LIMITS.nesting + 1} levels"),
    ({"type": "object", "properties": {f"p{i:05d}": {"const": "x" * 60} for i in range(2000)},
      "required": [f"p{i:05d}" for i in range(2000)]}, "bytes, more than"),
    ({"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(129)}}, "more than 128 optional"),
])
def test_a_grammar_past_its_bounds_is_a_400(schema: dict, what: str) -> None:
    assert what in refused(schema)


def test_measure_skips_strings_classes_and_comments() -> None:
    size = measure_gbnf('root ::= ("(" | [(|] | "a" ("b" | "c" | "d")) # ( | |\nx ::= "|" | "|"\n')
    assert (size.nesting, size.widest) == (2, 3)
