"""edge's schema -> GBNF converter against the audit of issue 39: each output the old grammar
accepted that was not JSON or broke an enforced keyword is now rejected by llama.cpp's grammar
sampler, fed byte by byte (kit.grammarwalk.accepts), and the valid neighbours are accepted."""

from __future__ import annotations

import pytest

from edge.errors import RequestError
from edge.serve.schema import schema_grammar
from kit.grammarwalk import accepts

P = "response_format.json_schema"
DEFS_CLASH = {"type": "object", "properties": {"a": {"$ref": "#/$defs/space"}, "b": {"$ref": "#/$defs/string"},
                                               "c": {"$ref": "#/definitions/x"}, "d": {"$ref": "#/$defs/x"}},
              "required": ["a", "b", "c", "d"],
              "$defs": {"space": {"type": "integer"}, "string": {"const": 5}, "x": {"type": "boolean"}},
              "definitions": {"x": {"type": "null"}}}

CASES = [  # (schema, accepted, rejected)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 1}', '{"a": 1, "b": 2}', '{"b": [1]}', '{}'], ['{"a": 1"b": {}}', '{"a": 1 "b": {}}', '{"a": 1,}']),
    ({"type": "string"}, ['"a\\nb"', '"a\\tb"', '"\\u001f"'], ['"a\nb"', '"a\tb"', '"\\u0041"', '"\\x"']),
    ({"type": "object"}, ['{"k": "a\\n"}'], ['{"k": "a\n"}']),
    ({"type": "string", "pattern": "^a\\tb\\n$"}, ['"a\\tb\\n"'], ['"a\tb\n"', '"a\\tb"']),
    (DEFS_CLASH, ['{"a": 5, "b": 5, "c": null, "d": true}'], ['{"a": , "b": 5, "c": null, "d": true}',
                                                              '{"a": 5, "b": "x", "c": true, "d": true}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     ['{"a": 1, "b": "x"}', '{"ab": "x"}', '{"b": "x"}'], ['{"a": "hello"}', '{"a": 1, "a": "x"}']),
    ({"allOf": [{"$ref": "#/$defs/o"}], "$defs": {"o": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                        "required": ["x"]}}}, ['{"x": 1}'], ["{}"]),
    ({"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"type": "string"}]}, ['"s"'], ["{}", "1"]),
    ({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ['["a", 1, 2]', '["a"]', "[]"],
     ["[1]", '["a", "b"]']),
    ({"type": "string", "format": "date"}, ['"2024-02-29"', '"2000-02-29"', '"2023-01-31"', '"2023-04-30"'],
     ['"2023-02-30"', '"1900-02-29"', '"2023-02-29"', '"2023-04-31"', '"0000-01-01"', '"2023-13-01"']),
    ({"type": "string", "minLength": 2}, ['"😀😀"', '"ab"', '"\\n😀"'], ['"😀"', '"a"']),
    ({"type": "string", "maxLength": 2}, ['"😀😀"', '"\\n\\t"'], ['"abc"']),
    ({"type": "object", "properties": {"名前": {"type": "string"}, 'x"y': {"type": "integer"}},
      "required": ["名前"]}, ['{"名前": "a", "x\\"y": 1}'], ['{"x\\"y": 1}']),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 10_000}, ["[1, 2]"], ['["a"]']),
    ({"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}}, ['{"b": 1}', '{"b": 1, "c": 2}'],
     ['{"b": "x"}', "{}"]),
    ({"type": "string", "maxLength": 10_000}, ['"' + "a" * 9999 + '"'], []),
]


@pytest.mark.parametrize("schema, good, bad", CASES)
def test_the_audits_outputs(grammar_walk: tuple, schema: dict, good: list[str], bad: list[str]) -> None:
    model, walker = grammar_walk
    compiled = model.compile_grammar(schema_grammar(schema, P), P)
    try:
        assert [t for t in good if not accepts(walker, compiled, t)] == []
        assert [t for t in bad if accepts(walker, compiled, t)] == []
    finally:
        compiled.close()


def test_ranges_as_documented_hold_at_their_ends(grammar_walk: tuple) -> None:
    model, walker = grammar_walk
    compiled = model.compile_grammar(schema_grammar({"type": "array", "items": {"type": "integer"},
                                                     "minItems": 1000, "maxItems": 10_000}, P), P)
    try:
        for n, ok in ((999, False), (1000, True), (10_000, True), (10_001, False)):
            assert accepts(walker, compiled, "[" + ",".join(["1"] * n) + "]") is ok, n
    finally:
        compiled.close()


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "enum": [1, 2]}, ".enum: no value of it is of type string"),
    ({"type": "integer", "const": "a"}, ".const: no value of it is of type integer"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ".allOf[1].type: no value is both"),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "null"}]}, ".anyOf[0].type: no value is both"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, ".properties.a: 'a' is required, but"),
    ({"type": "object", "required": ["b"], "additionalProperties": False}, ".required: 'b' is required, but"),
    ({"type": "string", "maxLength": 10_001}, ".maxLength: must be an integer from 0 to 10000"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 10_001}, ".minItems: must be an integer"),
    ({"$ref": "https://example.com/s.json"}, ".$ref: 'https://example.com/s.json': only references into"),
    ({"$ref": "#/$defs/nope"}, ".$ref: '#/$defs/nope' points to nothing"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, ".oneOf[1]: it and oneOf[0] may both match"),
    ({"type": "string", "format": "email"}, ".format: format 'email' is not enforced"),
    ({"type": "string", "pattern": "^(a?){0,900}$"}, ".pattern: a repeated part can match nothing"),
    ({"type": "string", "pattern": "^(a?)*$"}, ".pattern: a repeated part can match nothing"),
    ({"type": "string", "pattern": "^a(?=b)b$"}, ".pattern: lookarounds are not supported"),
    ({"type": "string", "pattern": "abc"}, ".pattern: the pattern must be anchored at both ends"),
    ({"type": "string", "pattern": "(?i)^a$"}, ".pattern: case-insensitive patterns"),
    ({"type": "string", "pattern": "^a{20000}$"}, ".pattern: asks for 20000 copies"),
    ({"properties": {"a": {"$id": "a.json", "$ref": "#"}}}, ".properties.a.$id: $id inside a schema"),
    ({"items": [{"type": "string"}]}, ".items: items as a list is draft 4-2019's tuple: write prefixItems"),
])
def test_unsatisfiable_or_unenforceable_is_a_400_naming_the_keyword(schema: dict, where: str) -> None:
    with pytest.raises(RequestError) as err:
        schema_grammar(schema, P)
    assert err.value.param == P and f"{P}{where}" in str(err.value), str(err.value)
