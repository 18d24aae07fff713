"""A JSON schema (`response_format.json_schema`, a forced tool call's `parameters`) made a GBNF
grammar for llama.cpp: every keyword enforced, refused with a 400 naming it, or ignored on
purpose (annotations), as KEYWORDS says (the README's table is checked against it).

The conversion is llama-cpp-python's `SchemaConverter` (llama.cpp's own, ported), with integer
ranges added (edge.serve.schemarange) and patterns read first as it reads them
(edge.serve.schemapattern). The converter picks one rule per schema (a `$ref`, a union, a
constant, an object, an array, a pattern, a format, a length, a primitive) and drops every
keyword of the others silently, so a keyword is enforced only beside the keywords of its own
rule (`RULES`); beside another rule's it is refused. The grammar it writes is then measured
(`measure_gbnf`): bytes, nesting of groups, the widest alternation; past GRAMMAR_LIMITS a 400.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from edge.errors import RequestError
from edge.serve.schemaenum import enum_gbnf
from edge.serve.schemapattern import MAX_REPEAT, json_safe, read_pattern
from edge.serve.schemarange import integer_bounds, range_gbnf, range_tree

__all__ = ["GRAMMAR_LIMITS", "KEYWORDS", "GrammarSize", "check_gbnf", "check_schema", "measure_gbnf",
           "schema_grammar"]

_E, _R, _I = "enforced", "refused", "ignored"
# keyword -> (status, how): the README's "json_schema keywords" table, row for row
KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (_E, "one type, or a list of them (any of them)"),
    "properties": (_E, "in the order given"),
    "required": (_E, "the other properties are optional"),
    "additionalProperties": (_E, "`false`, `true` or a schema"),
    "items": (_E, "a schema for every item, or a list of schemas (a tuple)"),
    "prefixItems": (_E, "a tuple"),
    "minItems": (_E, f"0..{MAX_REPEAT}, with `items` a schema"),
    "maxItems": (_E, f"0..{MAX_REPEAT}, with `items` a schema"),
    "enum": (_E, "any JSON values, as a trie of their JSON texts (only the characters that can come next are alternatives)"),
    "const": (_E, "any JSON value"),
    "anyOf": (_E, "one of the schemas"),
    "oneOf": (_E, "as `anyOf`: an output valid for two of the schemas is not prevented"),
    "allOf": (_E, "object schemas only: their properties merged, each required"),
    "$ref": (_E, "`#/...` within the schema; no other keyword beside it"),
    "$defs": (_E, "what `$ref` points to"),
    "definitions": (_E, "what `$ref` points to"),
    "pattern": (_E, "anchored `^...$`; read as llama.cpp's converter reads it, and refused where that differs from the regex; `.` and classes never write a quote, backslash or control character raw"),
    "minLength": (_E, f"0..{MAX_REPEAT}"),
    "maxLength": (_E, f"0..{MAX_REPEAT}"),
    "format": (_E, "`date`, `time`, `date-time`, `uuid` (others refused)"),
    "minimum": (_E, "on `integer` (a grammar of the range); on `number`: refused"),
    "maximum": (_E, "on `integer`; on `number`: refused"),
    "exclusiveMinimum": (_E, "on `integer`, a number or draft 4's boolean; on `number`: refused"),
    "exclusiveMaximum": (_E, "on `integer`, a number or draft 4's boolean; on `number`: refused"),
    "title": (_I, "an annotation"),
    "description": (_I, "an annotation"),
    "$schema": (_I, "an annotation"),
    "$id": (_I, "an annotation"),
    "$comment": (_I, "an annotation"),
    "default": (_I, "an annotation: the model is not told the default"),
    "examples": (_I, "an annotation"),
    "deprecated": (_I, "an annotation"),
    "readOnly": (_I, "an annotation"),
    "writeOnly": (_I, "an annotation"),
    **{k: (_R, "the converter has no rule for it") for k in (
        "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
        "if", "then", "else", "not", "contentEncoding", "contentMediaType", "contentSchema",
        "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$vocabulary", "nullable")},
}
_ANNOTATIONS = {k for k, (status, _) in KEYWORDS.items() if status == _I}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_TYPES = {"string", "integer", "number", "boolean", "null", "object", "array"}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_OPTIONAL_PROPERTIES = 128  # the converter's work grows with their square (900: 1.2 s, measured)

# the keywords each of the converter's rules reads (what else is in the schema, it drops)
RULES: dict[str, frozenset[str]] = {name: frozenset(keys) for name, keys in {
    "$ref": {"$ref", "$defs", "definitions"},
    "union": {"anyOf", "oneOf", "type", "$defs", "definitions"},
    "types": {"type"},
    "const": {"const", "type"},
    "enum": {"enum", "type"},
    "object": {"type", "properties", "required", "additionalProperties", "$defs", "definitions"},
    "allOf": {"type", "allOf", "$defs", "definitions"},
    "array": {"type", "items", "prefixItems", "minItems", "maxItems", "$defs", "definitions"},
    "pattern": {"type", "pattern"},
    "format": {"type", "format"},
    "length": {"type", "minLength", "maxLength"},
    "range": {"type", *_BOUNDS},
    "primitive": {"type", "$defs", "definitions"},
}.items()}


def _rule(s: dict[str, Any]) -> str:
    """Which of the converter's rules a schema takes (SchemaConverter.visit's order)."""
    t = s.get("type")
    if "$ref" in s:
        return "$ref"
    if "oneOf" in s or "anyOf" in s:
        return "union"
    if isinstance(t, list):
        return "types"
    for key in ("const", "enum"):
        if key in s:
            return key
    if t in (None, "object") and ("properties" in s or s.get("additionalProperties", True) is not True):
        return "object"
    if t in (None, "object") and "allOf" in s:
        return "allOf"
    if t in (None, "array") and ("items" in s or "prefixItems" in s):
        return "array" if not isinstance(s.get("items", s.get("prefixItems")), list) else "tuple"
    if t in (None, "string") and "pattern" in s:
        return "pattern"
    if t in (None, "string") and "format" in s:
        return "format"
    if t == "string" and ("minLength" in s or "maxLength" in s):
        return "length"
    if t == "integer" and any(k in s for k in _BOUNDS):
        return "range"
    return "primitive"


class _Check:
    def __init__(self, param: str, prefix: str) -> None:
        self.param, self.prefix = param, prefix  # the field a 400 names; the path its message starts at

    def bad(self, where: str, why: str) -> RequestError:
        return RequestError(f"{self.prefix}{where}: {why}", param=self.param)

    def schema(self, s: Any, where: str) -> None:
        if isinstance(s, bool) and where:
            return  # true/false as a subschema (additionalProperties: false)
        if not isinstance(s, dict):
            raise self.bad(where, "a schema must be a JSON object")
        for key in s:
            status = KEYWORDS.get(key, (None, ""))[0]
            if status is None:
                raise self.bad(f"{where}.{key}", f"{key!r} is not a JSON Schema keyword edge knows "
                               "(README: json_schema keywords)")
            if status == _R:
                raise self.bad(f"{where}.{key}", f"{key!r} is not enforced by llama.cpp's grammar "
                               "converter, so edge refuses it rather than ignore it")
        rule = _rule(s)
        self.values(s, where, rule)
        used = RULES["array"] if rule == "tuple" else RULES[rule]
        dropped = [k for k in s if k not in used and k not in _ANNOTATIONS]
        if rule == "tuple":
            dropped += [k for k in ("minItems", "maxItems") if k in s]
        if dropped:
            raise self.bad(f"{where}.{dropped[0]}", f"{dropped[0]!r} is not enforced beside "
                           f"{'/'.join(sorted(k for k in s if k in used)) or 'this schema'}: llama.cpp's "
                           "converter would drop it")
        for name in self.mapping(s, "properties", where):
            if "\\" in json.dumps(name):
                raise self.bad(f"{where}.properties", f"the property name {name!r} needs escaping in JSON, "
                               "which llama.cpp's converter writes wrongly")
        for key in _SCHEMA_MAPS:
            for name, sub in self.mapping(s, key, where).items():
                self.schema(sub, f"{where}.{key}.{name}")
        for key in _SCHEMA_LISTS + ("items",):
            subs = s.get(key)
            if isinstance(subs, list):
                for k, sub in enumerate(subs):
                    self.schema(sub, f"{where}.{key}[{k}]")
            elif key == "items" and subs is not None:
                self.schema(subs, f"{where}.items")
        if isinstance(s.get("additionalProperties"), dict):
            self.schema(s["additionalProperties"], f"{where}.additionalProperties")

    def mapping(self, s: dict[str, Any], key: str, where: str) -> dict[str, Any]:
        value = s.get(key, {})
        if not isinstance(value, dict):
            raise self.bad(f"{where}.{key}", f"{key} must be an object")
        return value

    def values(self, s: dict[str, Any], where: str, rule: str) -> None:
        t = s.get("type")
        types = t if isinstance(t, list) else [t] if t is not None else []
        if not all(isinstance(x, str) and x in _TYPES for x in types):
            raise self.bad(f"{where}.type", f"type must be one of {sorted(_TYPES)} or a list of them")
        for key in _COUNTS:
            v = s.get(key)
            if key in s and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPEAT):
                raise self.bad(f"{where}.{key}", f"must be an integer from 0 to {MAX_REPEAT} (a grammar "
                               "writes each repetition out)")
        if s.get("minItems", 0) > s.get("maxItems", MAX_REPEAT) or s.get("minLength", 0) > s.get("maxLength", MAX_REPEAT):
            raise self.bad(where, "its minimum is more than its maximum")
        if "pattern" in s:
            if not isinstance(s["pattern"], str):
                raise self.bad(f"{where}.pattern", "pattern must be a string")
            read_pattern(s["pattern"], f"{self.prefix}{where}.pattern", self.param)
        if "format" in s and s["format"] not in _FORMATS:
            raise self.bad(f"{where}.format", f"format {s['format']!r} is not enforced by llama.cpp's "
                           f"converter (it enforces {', '.join(sorted(_FORMATS))})")
        if any(k in s for k in _BOUNDS):
            if rule != "range":
                key = next(k for k in _BOUNDS if k in s)
                raise self.bad(f"{where}.{key}", f"{key} is enforced only on \"type\": \"integer\" "
                               "(a grammar of the integer range); not on numbers")
            try:
                integer_bounds(s)
            except ValueError as exc:
                raise self.bad(where, str(exc)) from None
        if isinstance(s.get("enum"), list):  # before anything is built from them
            size = sum(len(json.dumps(v)) for v in s["enum"])
            if size > GRAMMAR_LIMITS.bytes:
                raise self.bad(f"{where}.enum", f"its values' JSON is {size} bytes, more than the "
                               f"{GRAMMAR_LIMITS.bytes} bytes a grammar may be (README: grammar bounds)")
        for key in ("enum", "anyOf", "oneOf", "allOf", "prefixItems", "required"):
            if key in s and (not isinstance(s[key], list) or key != "required" and not s[key]):
                raise self.bad(f"{where}.{key}", f"{key} must be a non-empty list")
        props = s.get("properties")
        required = s.get("required") if isinstance(s.get("required"), list) else []
        missing = [k for k in required if k not in (props or {})] if rule == "object" else []
        if missing:  # the converter would leave them out of the grammar, so out of the output
            raise self.bad(f"{where}.required", f"{missing[0]!r} is required but not among the properties")
        if isinstance(props, dict) and len(set(props) - set(required)) > MAX_OPTIONAL_PROPERTIES:
            raise self.bad(f"{where}.properties", f"more than {MAX_OPTIONAL_PROPERTIES} optional properties "
                           "(llama.cpp's converter's work grows with their square)")
        for k, member in enumerate(s.get("allOf") or ()):
            extra = [x for x in member if x not in ("properties", "required", "type", "$ref", "anyOf",
                                                     *_ANNOTATIONS)] if isinstance(member, dict) else []
            if extra or isinstance(member, dict) and member.get("type", "object") != "object":
                raise self.bad(f"{where}.allOf[{k}]", "allOf is enforced for object schemas only "
                               "(properties, required)")


@functools.cache
def _converter_class() -> type:
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # type: ignore[misc,valid-type]
        def visit(self, schema: Any, name: str) -> str:
            rule = _rule(schema) if isinstance(schema, dict) else ""
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            if rule == "range":
                return self._add_rule(rule_name, range_gbnf(range_tree(*integer_bounds(schema))) + " space")
            if rule in ("enum", "const"):  # a trie, escaped (edge.serve.schemaenum)
                values = schema["enum"] if rule == "enum" else [schema["const"]]
                return self._add_rule(rule_name, enum_gbnf(values))
            return super().visit(schema, name)

        def _visit_pattern(self, pattern: str, name: str) -> str:
            return super()._visit_pattern(json_safe(pattern), name)  # no raw quote from `.` or a class

    return Converter


def _convert(schema: dict[str, Any]) -> str:
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = converter.resolve_refs(json.loads(json.dumps(schema)), "stdin")
    converter.visit(schema, "")
    return converter.format_grammar()


@dataclass(frozen=True)
class GrammarSize:
    bytes: int
    nesting: int  # groups inside groups: llama.cpp's parser recurses once per level
    widest: int  # the most alternatives of one rule or group: grammar stacks alive at once


# Measured on this project's 2-core VM (README "Grammar bounds"): a grammar within these compiles in
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
                               f"{most} a request may use (README: grammar bounds)", param=param)
    return size


def check_schema(schema: Any, param: str, prefix: str | None = None) -> None:
    """A 400 naming `param` (its message the keyword's path from `prefix`, default `param`) for
    what the grammar would not enforce, before anything is converted."""
    _Check(param, param if prefix is None else prefix).schema(schema, "")


def schema_grammar(schema: Any, param: str) -> str:
    """GBNF for a JSON schema; a 400 naming the keyword for what it would not enforce, or the
    field for a grammar past the bounds."""
    check_schema(schema, param)
    try:
        gbnf = _convert(schema)
    except RequestError:
        raise
    except Exception as exc:  # the converter raises ValueError/KeyError/AssertionError/...
        raise RequestError(f"{param}: llama.cpp cannot turn this JSON schema into a grammar: "
                           f"{type(exc).__name__}: {str(exc)[:300]}", param=param) from None
    check_gbnf(gbnf, param)
    return gbnf
