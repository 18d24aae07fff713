"""Issue 56's audit of the schema side: merges that keep every constraint (closed objects stay
closed over the merged properties, items against prefixItems position by position, the tighter
bound), oneOf that means exactly one (proved disjoint, compared as the validator reads each
alternative, values as JSON values), only JSON (no NaN, no infinity), enum beside const, regex
surrogate escapes and draft 4's boolean exclusives: each output the grammar used to take that the
schema does not is now rejected by the compiled grammar and its guard, fed byte by byte
(kit.grammarwalk.accepts), its valid neighbours accepted, and what cannot be kept is a 400 naming
the keyword."""

from __future__ import annotations

import pytest

from edge.errors import RequestError
from edge.serve.schema import schema_grammar
from edge.serve.schema.disjoint import disjoint
from edge.serve.schema.values import json_key
from kit.grammarwalk import accepts
from kit.schemacheck import invalid

P = "response_format.json_schema"
CLOSED = {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": False}

CASES = [  # (schema, accepted, rejected): every accepted one valid, every rejected one invalid
    ({"$ref": "#/$defs/base", "properties": {"name": {"type": "string"}}, "$defs": {"base": CLOSED}},
     ['{"id": 1}', "{}"], ['{"id": 1, "name": "x"}', '{"name": "x"}']),
    ({"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"id": {"minimum": 3}}, "required": ["id"]}],
      "$defs": {"base": CLOSED}}, ['{"id": 3}'], ['{"id": 2}', "{}", '{"id": 3, "x": 1}']),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
                {"properties": {"b": {"type": "integer"}}}]},
     ['{"a": 1}', '{"a": 1, "x": "s"}'], ['{"b": 1}', '{"a": 1, "x": 2}']),
    ({"allOf": [{"items": {"type": "integer"}}, {"prefixItems": [{"type": "string"}]}]}, ["[]"], ['["x"]', "[1]"]),
    ({"allOf": [{"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
                {"prefixItems": [{"minimum": 5}, {"type": "string"}]}]}, ["[5]", "[]"], ["[4]", '[5, "x"]']),
    ({"allOf": [{"type": "string", "maxLength": 4}, {"minLength": 2, "maxLength": 6}]}, ['"ab"', '"abcd"'],
     ['"a"', '"abcde"']),
    ({"allOf": [{"type": "integer", "minimum": -3}, {"maximum": 40, "minimum": 0}, {"exclusiveMaximum": 30}]},
     ["0", "29"], ["-1", "30", "40"]),
    ({"allOf": [{"enum": [1, "a", 2.0, None]}, {"enum": [1.0, 2, "b"]}]}, ["1", "2.0"], ['"a"', "null"]),
    ({"$ref": "#/$defs/e", "type": "string", "$defs": {"e": {"enum": ["a", 1, None]}}}, ['"a"'], ["1", "null"]),
    ({"enum": ["a", "b"], "const": "b"}, ['"b"'], ['"a"']),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
                {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},
     ['{"kind": "a", "x": 1}', '{"kind": "b"}'], ['{"kind": "c"}']),
    ({"type": "string", "oneOf": [{"maxLength": 2}, {"minLength": 3}]}, ['"ab"', '"abc"'], ["1"]),
    ({"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}, {"type": "string"}]},
     ["0", "1", '"x"'], ["1.5"]),
    ({"oneOf": [{"const": 1}, {"type": "integer", "minimum": 2}]}, ["1", "2"], ["0"]),
    ({"oneOf": [{"const": 0}, {"const": False}, {"const": None}, {"const": ""}]}, ["0", "false", "null", '""'], ["1"]),
    ({"allOf": [{"$ref": "#/$defs/t"}, {"$ref": "#/$defs/t"}, {"required": ["v"]}], "$defs": {"t": {  # A and A is A
        "type": "object", "properties": {"k": {"$ref": "#/$defs/t"}, "v": {"type": "integer"}}}}},
     ['{"v": 1}', '{"k": {}, "v": 1}', '{"k": {"k": {"v": 3}}, "v": 2}'], ["{}", '{"k": {}}', '{"k": {"v": "x"}, "v": 1}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{"x": 1, "y": 2}'], ['{"x": 1, "x": 2}']),
    ({"type": "object"}, ['{"a/": 1, "b": {"a/": 2}}'], ['{"a/": 1, "a\\/": 2}', '{"a": {"k": 1, "k": 2}}']),
]


@pytest.mark.parametrize("schema, good, bad", CASES)
def test_merged_and_one_of_outputs_are_held_to_the_schema(grammar_walk: tuple, schema: dict, good: list[str],
                                                          bad: list[str]) -> None:
    model, walker = grammar_walk
    compiled = model.compile_grammar(schema_grammar(schema, P), P)
    try:
        assert [t for t in good if invalid(schema, t) or not accepts(walker, compiled, t)] == []
        assert [t for t in bad if not invalid(schema, t)] == []  # the cases are right: each is invalid
        assert [t for t in bad if accepts(walker, compiled, t)] == []
    finally:
        compiled.close()


@pytest.mark.parametrize("schema, where", [
    ({"oneOf": [{"type": "string"}, {"minimum": 5}]}, ".oneOf[1]: it and oneOf[0] may both match"),
    ({"type": "string", "maxLength": 4, "oneOf": [{"maxLength": 10}, {"minLength": 1}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"oneOf": [{"const": 1}, {"const": 1.0}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"oneOf": [{"const": 0}, {"const": -0.0}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"oneOf": [{"const": {"a": 1, "b": [2]}}, {"const": {"b": [2], "a": 1}}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"oneOf": [{"maxLength": 3}, {"minLength": 5}]}, ".oneOf[1]: it and oneOf[0]"),
    ({"allOf": [{"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"oneOf": [{"minLength": 1}, {"type": "string"}]}]},
     "may both match"),
    ({"const": float("inf")}, ".const: NaN and the infinities are no JSON values"),
    ({"enum": [1, float("nan")]}, ".enum[1]: NaN and the infinities"),
    ({"const": {"a": [float("-inf")]}}, ".const.a[0]: NaN and the infinities"),
    ({"type": "integer", "minimum": float("inf")}, ".minimum: minimum must be a finite number"),
    ({"enum": ["a", "b"], "const": "c"}, ".const: enum and const have no value in common"),
    ({"allOf": [{"enum": [1, 2]}, {"const": 3}]}, "no value is in every enum/const given"),
    ({"type": "string", "pattern": "^\\ud83d\\ude00$"}, ".pattern: \\ud83d is half of a UTF-16 surrogate pair"),
    ({"type": "integer", "minimum": -5, "exclusiveMinimum": True}, ".exclusiveMinimum: true is draft 4's form"),
    ({"type": "integer", "maximum": 5, "exclusiveMaximum": False}, ".exclusiveMaximum: false is draft 4's form"),
    ({"allOf": [{"type": "string", "pattern": "^a$"}, {"pattern": "^b$"}]}, ".allOf[1].pattern: allOf sets pattern twice"),
    ({"allOf": [{"type": "object", "additionalProperties": False}, {"required": ["x"]}]},
     ".allOf[1].required: 'x' is required, but its schema is `false`"),
    ({"allOf": [{"type": "string", "maxLength": 2}, {"minLength": 3}]}, "minLength 3 is more than maxLength 2"),
    ({"allOf": [{"anyOf": [{"type": "object", "properties": {f"{p}{i}": {"type": "integer"}}} for i in range(60)]}
                for p in "abc"]}, "it makes more than 256 alternatives"),  # was 216,000 merges, 110 s of a core
])
def test_what_cannot_be_kept_is_a_400_naming_the_keyword(schema: dict, where: str) -> None:
    with pytest.raises(RequestError) as err:
        schema_grammar(schema, P)
    assert err.value.param == P and where in str(err.value), str(err.value)


def test_json_values_compare_as_json_schema_compares_them() -> None:
    assert json_key(1) == json_key(1.0) and json_key(0) == json_key(-0.0)
    assert json_key({"a": 1, "b": [2.0]}) == json_key({"b": [2], "a": 1})
    assert json_key(True) != json_key(1) and json_key(False) != json_key(0) and json_key(None) != json_key(0)
    assert json_key(2**53 + 1) != json_key(float(2**53))
    assert json_key([1, 2]) != json_key([2, 1]) and json_key("1") != json_key(1)


@pytest.mark.parametrize("a, b, apart", [
    ({"type": "string"}, {"type": "integer"}, True),
    ({"type": "integer"}, {"type": "number"}, False),
    ({"type": "string"}, {"minimum": 5}, False),  # the validator takes every string for {"minimum": 5}
    ({"const": "a"}, {"type": "string", "minLength": 2}, True),
    ({"const": "ab"}, {"type": "string", "minLength": 2}, False),
    ({"const": "ab"}, {"type": "string", "pattern": "^a$"}, False),  # no client regex is run on a value
    ({"enum": [1, 2]}, {"type": "integer", "minimum": 3}, True),
    ({"enum": [1, 2]}, {"type": "integer", "exclusiveMinimum": 1}, False),
    ({"type": "array", "maxItems": 1}, {"type": "array", "minItems": 2}, True),
    ({"type": "array", "prefixItems": [{"const": 1}], "minItems": 1},
     {"type": "array", "prefixItems": [{"const": 2}], "minItems": 1}, True),
    ({"type": "array", "prefixItems": [{"const": 1}]}, {"type": "array", "prefixItems": [{"const": 2}]}, False),
    ({"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}, True),
    ({"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": 2}}}, False),  # {} matches the second
    ({"anyOf": [{"type": "null"}, {"type": "boolean"}]}, {"type": ["string", "integer"]}, True),
    ({"$ref": "#/$defs/s"}, {"type": "integer"}, True),
    ({}, {"type": "integer"}, False),
    (False, {}, True),
])
def test_disjointness_is_proved_or_not_claimed(a: object, b: object, apart: bool) -> None:
    root = {"$defs": {"s": {"type": "string"}}}
    assert disjoint(a, b, root, "") is apart and disjoint(b, a, root, "") is apart
