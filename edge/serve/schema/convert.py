"""edge's own JSON schema -> GBNF converter: every output the grammar accepts is JSON that the
schema accepts (tested: tests/serve/test_schemaproperty.py walks the grammars).

- Strings: any character but a quote, a backslash or a control character raw, or one of JSON's
  escapes (`\\n`, `\\u001f`...); each is one code point, so `minLength`/`maxLength` count code
  points as JSON Schema does. Repetitions past llama.cpp's 2,000 are written as blocks.
- Objects: the properties in the order given, each optional one skipped or written, commas only
  between members; the next key is chosen by a trie of the allowed names, so optional
  properties are no alternatives kept open at once. Extra keys (`additionalProperties`) come
  last, and a trie keeps them off every declared name.
- `$ref`: a JSON pointer into the schema; each target one rule, named by number (`ref-3`):
  no name a client writes ever becomes a rule name, so nothing collides with the built-in rules
  (`j-...`).
- Conjunctions (`allOf`, `type` beside `enum`/`anyOf`, a `$ref` beside keywords) are merged
  first (edge.serve.schema.merge) or refused.

Beside the text, each rule gets a cost node (edge.serve.schema.stacks) from which the worst number
of grammar stacks llama.cpp keeps at once is bounded before the grammar is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from edge.serve.schema.pattern import pattern_gbnf
from edge.serve.schema.enums import enum_gbnf
from edge.serve.schema.formats import FORMAT_RULES
from edge.serve.schema.disjoint import disjoint
from edge.serve.schema.merge import ANNOTATIONS, Refused, flatten, pointer, type_set
from edge.serve.schema.ranges import integer_bounds, range_gbnf, range_tree
from edge.serve.schema.repeat import MAX_REPEAT, repeat
from edge.serve.schema.objects import array_part, object_part
from edge.serve.schema.stacks import Cost, Part, alt, leaf, ref

__all__ = ["BUILTINS", "Converted", "convert"]

# the built-in rules: every name starts with "j-", which no generated rule does
BUILTINS: dict[str, str] = {
    "j-ws": '" "?',  # at most one space: a model that likes whitespace cannot spend its tokens on it
    "j-char": '[^"\\\\\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u00" [01] [0-9a-fA-F])',
    "j-kchar": '[^"\\\\\\x00-\\x1F]',
    "j-string": '"\\"" j-char* "\\""',
    "j-int": '"-"? ("0" | [1-9] [0-9]{0,15})',
    "j-number": 'j-int ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?',
    "j-bool": '"true" | "false"',
    "j-null": '"null"',
    "j-value": "j-object | j-array | j-string | j-number | j-bool | j-null",
    "j-kv": 'j-string j-ws ":" j-ws j-value',
    "j-object": '"{" j-ws (j-kv (j-ws "," j-ws j-kv)* j-ws)? "}"',
    "j-array": '"[" j-ws (j-value (j-ws "," j-ws j-value)* j-ws)? "]"',
}
_FIRST = {"object": "{", "array": "[", "string": '"', "integer": "0", "number": "0", "boolean": "tf", "null": "n"}
_ANY = frozenset("{[\"0tfn")
_STRING_KEYS = ("pattern", "format", "minLength", "maxLength")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems")
_OBJECT_KEYS = ("properties", "required", "additionalProperties")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPE_KEYS = {"string": _STRING_KEYS, "array": _ARRAY_KEYS, "object": _OBJECT_KEYS,
              "integer": _NUMBER_KEYS, "number": _NUMBER_KEYS, "boolean": (), "null": ()}


@dataclass
class Converted:
    gbnf: str
    rules: dict[str, Cost]  # each generated rule's cost node (the root's is "root")


def _first(values: list[Any]) -> frozenset[str]:
    return frozenset(("0" if (t := json.dumps(v)[0]) in "-0123456789" else t) for v in values)


class _Converter:
    def __init__(self, root: Any, pattern: Any) -> None:
        self.root, self.pattern = root, pattern  # pattern(converter, text, where) -> (gbnf, stacks)
        self.rules: dict[str, str] = {}
        self.costs: dict[str, Cost] = {}
        self.refs: dict[str, str] = {}  # pointer -> rule name
        self.firsts: dict[str, frozenset[str]] = {}  # a ref rule's first characters

    def rule(self, text: str, cost: Cost, prefix: str = "s") -> str:
        """A new rule holding `text`; its name, numbered (never a client's text)."""
        name = f"{prefix}-{len(self.rules)}"
        self.rules[name], self.costs[name] = text, cost
        return name

    @staticmethod
    def builtin(name: str) -> Part:
        kinds = {"j-string": '"', "j-int": "0", "j-number": "0", "j-bool": "tf", "j-null": "n",
                 "j-object": "{", "j-array": "["}
        return Part(name, leaf(1), frozenset(kinds.get(name, _ANY)))

    def visit(self, s: Any, where: str) -> Part:
        s = flatten(s, where, self.root)  # annotations dropped, conjunctions merged, const an enum
        if s is True or s == {}:
            return self.builtin("j-value")
        if s is False:
            raise Refused(where or "schema", "the schema `false` matches nothing: no output could match")
        if set(s) == {"$ref"}:
            return self.reference(s["$ref"], where)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.union(s[key], key, where)
        if "enum" in s:
            return self.values(s, where)
        types = type_set(s, where)
        if types is None:
            types = self.implied_types(s, where)
        return self.typed(s, types, where)

    def reference(self, target: str, where: str) -> Part:
        name = self.refs.get(target)
        if name is None:
            name = self.refs[target] = f"ref-{len(self.refs)}"
            self.rules[name] = ""  # taken: a cycle back to it refers to the name
            part = self.visit(pointer(self.root, target, where), f"{where}.$ref({target})")
            if part.text == name:
                raise Refused(f"{where}.$ref", f"{target!r} refers to itself and nothing else")
            self.rules[name], self.costs[name], self.firsts[name] = part.text, part.cost, part.firsts
        return Part(name, ref(name), self.firsts.get(name, _ANY))  # in a cycle: not known yet

    def union(self, alts: list[Any], key: str, where: str) -> Part:
        if all(a is False for a in alts):
            raise Refused(f"{where}.{key}", "every alternative is `false`: no output could match")
        kept = [(i, a) for i, a in enumerate(alts) if a is not False]  # false matches nothing: no alternative
        parts = [self.visit(a, f"{where}.{key}[{i}]") for i, a in kept]
        if key == "oneOf":
            self.disjoint(kept, where)
        text = "(" + " | ".join(p.text for p in parts) + ")"
        return Part(text, alt([(p.firsts, p.cost) for p in parts]), frozenset().union(*(p.firsts for p in parts)))

    def disjoint(self, alts: list[tuple[int, Any]], where: str) -> None:
        """oneOf holds only if no value matches two alternatives (edge.serve.schema.disjoint)."""
        for n, (i, a) in enumerate(alts):
            for j, b in alts[:n]:
                if not disjoint(a, b, self.root, f"{where}.oneOf[{i}]"):
                    raise Refused(f"{where}.oneOf[{i}]", f"it and oneOf[{j}] may both match one value, and oneOf "
                                  "means exactly one, which a grammar cannot check; edge takes oneOf where it can "
                                  "prove no value matches two (other types, other const/enum values, lengths, "
                                  "ranges or item counts that do not meet, a required property whose schemas do "
                                  "not): write anyOf if either may match")

    def values(self, s: dict[str, Any], where: str) -> Part:
        extra = [k for k in s if k != "enum"]
        if extra:
            raise Refused(f"{where}.{extra[0]}", f"{extra[0]!r} is not enforced beside enum/const: list only "
                          "the values that hold")
        values = s["enum"]
        text = enum_gbnf(values)
        return Part(text if len(values) == 1 else f"({text})", leaf(1), _first(values))

    def implied_types(self, s: dict[str, Any], where: str) -> set[str]:
        """No `type`: the one whose keywords are there (all types if none are)."""
        found = {t for t, keys in _TYPE_KEYS.items() if t != "number" and any(k in s for k in keys)}
        if len(found) > 1:
            raise Refused(where, f"keywords of several types ({', '.join(sorted(found))}) and no `type`: "
                          "write `type`")
        return found or set(_TYPE_KEYS)

    def typed(self, s: dict[str, Any], types: set[str], where: str) -> Part:
        if "integer" in types and "number" in types:
            types = types - {"integer"}
        own = {k for t in types for k in _TYPE_KEYS[t]}
        # a keyword of another type constrains nothing here (maxLength on an integer), but
        # bounds on a number are a constraint edge cannot write
        stray = [k for k in s if k not in own and k != "type" and (k in _NUMBER_KEYS and "number" in types
                                                                     or not any(k in ks for ks in _TYPE_KEYS.values()))]
        if stray:
            raise Refused(f"{where}.{stray[0]}", f"{stray[0]!r} is not enforced on type {'/'.join(sorted(types))}"
                          + (" (minimum and friends are enforced only on \"type\": \"integer\")"
                             if stray[0] in _NUMBER_KEYS else ""))
        parts = [self.one_type(t, {k: v for k, v in s.items() if k in _TYPE_KEYS[t]}, where)
                 for t in sorted(types)]
        if len(parts) == 1:
            return parts[0]
        return Part("(" + " | ".join(p.text for p in parts) + ")", alt([(p.firsts, p.cost) for p in parts]),
                    frozenset().union(*(p.firsts for p in parts)))

    def one_type(self, t: str, s: dict[str, Any], where: str) -> Part:
        if t == "string":
            return self.string(s, where)
        if t == "object":
            return object_part(self, s, where)
        if t == "array":
            return array_part(self, s, where)
        if t == "integer" and s:
            try:
                lo, hi = integer_bounds(s)
            except ValueError as exc:
                raise Refused(where, str(exc)) from None
            return Part("(" + range_gbnf(range_tree(lo, hi)) + ")", leaf(1), frozenset("0"))
        if t == "number" and s:
            key = next(iter(s))
            raise Refused(f"{where}.{key}", f"{key} is enforced only on \"type\": \"integer\" (a grammar of "
                          "the integer range); not on numbers")
        return self.builtin({"integer": "j-int", "number": "j-number", "boolean": "j-bool", "null": "j-null"}[t])

    def string(self, s: dict[str, Any], where: str) -> Part:
        kinds = [k for k in ("pattern", "format") if k in s]
        if kinds and len(s) > 1:
            other = next(k for k in s if k != kinds[0])
            raise Refused(f"{where}.{other}", f"{other!r} is not enforced beside {kinds[0]}: write it into the "
                          + ("pattern" if kinds[0] == "pattern" else "schema as a pattern"))
        if "pattern" in s:
            text, n = self.pattern(self, s["pattern"], f"{where}.pattern")
            return Part(f'"\\"" {text} "\\""', leaf(n), frozenset('"'))
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMAT_RULES:
                raise Refused(f"{where}.format", f"format {fmt!r} is not enforced (edge enforces "
                              f"{', '.join(sorted(FORMAT_RULES))})")
            for name, text in FORMAT_RULES[fmt].items():
                self.rules.setdefault(name, text)
                self.costs.setdefault(name, leaf(2))
            return Part(f'"\\"" f-{fmt} "\\""', ref(f"f-{fmt}"), frozenset('"'))
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        for key, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPEAT):
                raise Refused(f"{where}.{key}", f"must be an integer from 0 to {MAX_REPEAT}")
        if hi is not None and lo > hi:
            raise Refused(where, "minLength is more than maxLength")
        if lo == 0 and hi is None:
            return self.builtin("j-string")
        body, mult = repeat(self, "j-char", lo, hi)
        return Part(f'"\\"" {body} "\\""', leaf(mult), frozenset('"'))

    def grammar(self, root: Part) -> str:
        """The whole GBNF text: root first, the generated rules, then every built-in (llama.cpp
        keeps unused rules without cost)."""
        self.rules["root"], self.costs["root"] = root.text, root.cost
        lines = [f"root ::= {root.text}"] + [f"{n} ::= {t}" for n, t in self.rules.items() if n != "root"]
        return "\n".join(lines + [f"{n} ::= {t}" for n, t in BUILTINS.items()]) + "\n"


def convert(schema: Any) -> Converted:
    """GBNF for `schema` (Refused naming the keyword), with each rule's cost node."""
    c = _Converter(schema, pattern_gbnf)
    root = c.visit(schema, "")
    text = c.grammar(root)
    return Converted(text, c.costs)
