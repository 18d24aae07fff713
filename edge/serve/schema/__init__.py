"""A JSON schema (`response_format.json_schema`, a forced tool call's `parameters`) made a GBNF
grammar for llama.cpp: every keyword enforced, refused with a 400 naming it, or ignored on
purpose (annotations), as KEYWORDS says (docs/api.md's table is checked against it, and
tests/serve/test_schemaproperty.py holds every grammar's outputs to the schema with the
`jsonschema` validator).

The conversion is edge's own (edge.serve.schema.convert, with objects, merge, disjoint, values,
formats, pattern, ranges, enums). The grammar it writes is then bounded twice
before anything compiles it: its size (`measure_gbnf`: bytes, nesting of groups, the widest
alternation; GRAMMAR_LIMITS) and its work (edge.serve.schema.stacks: the most grammar stacks
llama.cpp can keep at once, MAX_STACKS). Past either, a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.errors import RequestError
from edge.serve.schema.merge import Refused
from edge.serve.schema.ranges import integer_bounds
from edge.serve.schema.values import not_json
from edge.serve.schema.objects import MAX_OPTIONAL_PROPERTIES
from edge.serve.schema.repeat import MAX_REPEAT
from edge.serve.schema.stacks import MAX_STACKS, stacks

__all__ = ["GRAMMAR_LIMITS", "KEYWORDS", "MAX_OPTIONAL_PROPERTIES", "MAX_STACKS", "GrammarSize", "check_gbnf",
           "measure_gbnf", "schema_grammar"]

_E, _R, _I = "enforced", "refused", "ignored"
# keyword -> (status, how): docs/api.md's "json_schema keywords" table, row for row
KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (_E, "one type, or a list of them (any of them); beside `enum`/`const`: the values of that type "
                 "(none: refused); beside `anyOf`/`oneOf`: each alternative of that type"),
    "properties": (_E, "in the order given; any name, non-ASCII and escaped ones too"),
    "required": (_E, "the other properties are optional; a required name not in `properties` takes any value"),
    "additionalProperties": (_E, "`false`, `true` or a schema, after the declared properties, never with "
                                 "a declared name; absent beside `properties`/`required`: no others"),
    "items": (_E, "a schema for every item after `prefixItems`; `false`: none (a list, draft 4's tuple: "
                  "refused, write `prefixItems`)"),
    "prefixItems": (_E, "the first items, in order; then `items`"),
    "minItems": (_E, f"0..{MAX_REPEAT}"),
    "maxItems": (_E, f"0..{MAX_REPEAT}"),
    "enum": (_E, "any JSON values, as a trie of their JSON texts (only the characters that can come next are "
                 "alternatives); NaN or an infinity: refused; beside `const`: the values in both (none: refused)"),
    "const": (_E, "any JSON value (NaN or an infinity: refused)"),
    "anyOf": (_E, "one of the schemas"),
    "oneOf": (_E, "one of the schemas, where edge proves no value matches two (as the validator reads each: other "
                  "types, other values, lengths, ranges or item counts apart, a required property with disjoint "
                  "schemas); else refused"),
    "allOf": (_E, "merged into one schema that keeps every constraint: each property gets what every member asks "
                  "of it (closed members stay closed), prefixItems merged by position, the tighter bound, types "
                  "and values intersected, `anyOf`/`oneOf` distributed; `pattern`/`format` set twice differently: "
                  "refused"),
    "$ref": (_E, "a JSON pointer into the schema (`#`, `#/$defs/x`); beside other keywords, merged as `allOf`"),
    "$defs": (_E, "what `$ref` points to"),
    "definitions": (_E, "what `$ref` points to"),
    "pattern": (_E, "Python's `re`, anchored `^...$`; `\\d` `\\w` `\\s` as their ASCII members; lookarounds, "
                    "back-references, inner anchors, `(?i)`, a repeated part that can match nothing, a surrogate "
                    "escape (`\\ud83d`): refused"),
    "minLength": (_E, f"0..{MAX_REPEAT} code points (an escape counts as the one character it writes)"),
    "maxLength": (_E, f"0..{MAX_REPEAT} code points"),
    "format": (_E, "`date` (the days of each month, February 29 in leap years), `time`, `date-time` "
                   "(RFC 3339), `uuid` (others refused)"),
    "minimum": (_E, "on `integer` (a grammar of the range); on `number`: refused"),
    "maximum": (_E, "on `integer`; on `number`: refused"),
    "exclusiveMinimum": (_E, "on `integer`, a number (2020-12; draft 4's boolean: refused); on `number`: refused"),
    "exclusiveMaximum": (_E, "on `integer`, a number (2020-12; draft 4's boolean: refused); on `number`: refused"),
    "title": (_I, "an annotation"),
    "description": (_I, "an annotation"),
    "$schema": (_I, "an annotation"),
    "$id": (_I, "an annotation at the root; inside, refused (it would change what `#` points to)"),
    "$comment": (_I, "an annotation"),
    "default": (_I, "an annotation: the model is not told the default"),
    "examples": (_I, "an annotation"),
    "deprecated": (_I, "an annotation"),
    "readOnly": (_I, "an annotation"),
    "writeOnly": (_I, "an annotation"),
    **{k: (_R, "the grammar has no rule for it") for k in (
        "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
        "if", "then", "else", "not", "contentEncoding", "contentMediaType", "contentSchema",
        "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$vocabulary", "nullable")},
}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")


def _count(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_REPEAT
    return None if ok else f"must be an integer from 0 to {MAX_REPEAT}"


def _bound(key: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        try:
            integer_bounds({key: v})
        except ValueError as exc:
            return str(exc)
        return None
    return check


def _values(v: Any) -> str | None:
    return None if isinstance(v, list) and v else "enum must be a non-empty list"


def _items(v: Any) -> str | None:
    return "items as a list is draft 4-2019's tuple: write prefixItems" if isinstance(v, list) else None


def _required(v: Any) -> str | None:
    ok = isinstance(v, list) and all(isinstance(r, str) for r in v) and len(set(v)) == len(v)
    return None if ok else "required must be a list of distinct names"


# keyword -> what its value must be (an error message, or None): checked everywhere in the schema
# before anything merges or converts it
_VALUE_CHECKS: dict[str, Callable[[Any], str | None]] = {
    **{k: _count for k in ("minLength", "maxLength", "minItems", "maxItems")},
    **{k: _bound(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
    "enum": _values, "items": _items, "required": _required,
}


def _check_values(s: dict[str, Any], where: str) -> None:
    for key, check in _VALUE_CHECKS.items():
        why = check(s[key]) if key in s else None
        if why is not None:
            raise Refused(f"{where}.{key}", why)
    for key in ("enum", "const"):
        bad = not_json(s[key]) if key in s else None
        if bad is not None:
            at = "" if bad == "<value>" else bad
            raise Refused(f"{where}.{key}{at}", "NaN and the infinities are no JSON values (the grammar would "
                          "write `NaN` or `Infinity`, which no JSON parser reads): give finite numbers")


def _walk(s: Any, where: str) -> None:
    """Refused for a keyword edge does not know or does not enforce, or a value no keyword may
    have, anywhere in the schema."""
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise Refused(where, "a schema must be a JSON object (or true/false)")
    for key in s:
        status = KEYWORDS.get(key, (None, ""))[0]
        if status is None:
            raise Refused(f"{where}.{key}", f"{key!r} is not a JSON Schema keyword edge knows "
                          "(docs/api.md: json_schema keywords)")
        if status == _R:
            raise Refused(f"{where}.{key}", f"{key!r} is not enforced by edge's grammar, so edge refuses "
                          "it rather than ignore it")
    if "$id" in s and where:  # a resource of its own: `#` inside it would point into it, not the root
        raise Refused(f"{where}.$id", "$id inside a schema is not supported: `#` in a $ref would point "
                      "into that schema, not the root")
    _check_values(s, where)
    for key in _SCHEMA_MAPS:
        if key in s:
            if not isinstance(s[key], dict):
                raise Refused(f"{where}.{key}", f"{key} must be an object")
            for name, sub in s[key].items():
                _walk(sub, f"{where}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if key in s:
            if not isinstance(s[key], list) or not s[key]:
                raise Refused(f"{where}.{key}", f"{key} must be a non-empty list")
            for i, sub in enumerate(s[key]):
                _walk(sub, f"{where}.{key}[{i}]")
    for key in _SCHEMA_ONE:
        if key in s:
            _walk(s[key], f"{where}.{key}")


@dataclass(frozen=True)
class GrammarSize:
    bytes: int
    nesting: int  # groups inside groups: llama.cpp's parser recurses once per level
    widest: int  # the most alternatives of one rule or group: grammar stacks alive at once


# Measured on this project's 2-core VM (docs/api.md, "Grammar bounds"): a grammar within these compiles in
# well under 0.1 s, and the widest alternation costs about 0.2 s per token on Gemma 3's 262k vocabulary.
GRAMMAR_LIMITS = GrammarSize(bytes=128 * 1024, nesting=1000, widest=256)


def measure_gbnf(text: str) -> GrammarSize:
    """Bytes, deepest group nesting, widest alternation of a GBNF text (strings, character
    classes and comments skipped)."""
    deepest = widest = 0
    alts = [1]  # per open group, and the rule's own at the bottom
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            alts.append(1)
            deepest = max(deepest, len(alts) - 1)
        elif c == ")" and len(alts) > 1:
            widest = max(widest, alts.pop())
        elif c == "|":
            alts[-1] += 1
        elif c == ":" and text.startswith("::=", i):
            widest, alts = max(widest, alts[0]), [1]
        i += 1
    return GrammarSize(len(text.encode("utf-8")), deepest, max(widest, alts[0]))


def check_gbnf(gbnf: str, param: str) -> GrammarSize:
    size, limit = measure_gbnf(gbnf), GRAMMAR_LIMITS
    for what, value, most in (("is", size.bytes, limit.bytes), ("nests groups", size.nesting, limit.nesting),
                              ("has an alternation of", size.widest, limit.widest)):
        if value > most:
            unit = " bytes" if what == "is" else (" levels" if what == "nests groups" else " choices")
            raise RequestError(f"{param}: the grammar made from it {what} {value}{unit}, more than the "
                               f"{most} a request may use (docs/api.md: grammar bounds)", param=param)
    return size


def schema_grammar(schema: Any, param: str, place: Callable[[str], str] | None = None) -> str:
    """GBNF for a JSON schema; a 400 naming `param`, its message the keyword's path as the client
    wrote it (`place(path)`; default: `param` then the path), for what edge would not enforce,
    or naming the field for a grammar past the bounds (size or work)."""
    from edge.serve.schema.convert import convert

    name = place or (lambda path: param + path)
    try:
        _walk(schema, "")
        if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
            size = sum(len(json.dumps(v)) for v in schema["enum"])
            if size > GRAMMAR_LIMITS.bytes:  # before a trie is built of them
                raise Refused(".enum", f"its values' JSON is {size} bytes, more than the {GRAMMAR_LIMITS.bytes} "
                              "bytes a grammar may be (docs/api.md: grammar bounds)")
        converted = convert(schema)
    except Refused as exc:
        raise RequestError(f"{name(exc.where)}: {exc.why}", param=param) from None
    except RecursionError:
        raise RequestError(f"{name('')}: the schema nests too deep to convert", param=param) from None
    check_gbnf(converted.gbnf, param)
    if stacks(converted.rules) > MAX_STACKS:
        raise RequestError(f"{name('')}: the grammar made from it can keep more than {MAX_STACKS} grammar stacks "
                           "alive at once (alternatives that start alike, nested through $ref or repeated), "
                           "each checked against every token (docs/api.md: grammar bounds)", param=param)
    return converted.gbnf
