"""A JSON schema `pattern` as GBNF, read by Python's own regex parser (the `re` module that
JSON Schema validators in Python match with), so the grammar means what the regex means.

The grammar writes the JSON text of the string: every character the regex names is written as
JSON must write it (a quote, a backslash or a control character as its escape, never raw). The
grammar's language may be smaller than the regex's, never larger:
- `\\d`, `\\w`, `\\s` are their ASCII members (`re` also takes other scripts' digits); their
  negations and negated classes holding them are taken within ASCII;
- `$` does not take the final newline `re` lets it take.
Refused (400, naming the field): a pattern not anchored at both ends (`^...$`), lookarounds,
back-references, conditionals, atomic groups and possessive repetitions, `\\b` and other inner
anchors, case-insensitive flags, a repetition of a part that can match nothing (`(a?)*`: as
many readings as repetitions, each a grammar stack), more than MAX_REPEAT copies of one part,
groups nested deeper than MAX_PATTERN_GROUP_DEPTH.

`pattern_gbnf` answers the GBNF and an estimate of the grammar stacks it can keep at once
(edge.serve.schema.stacks): alternatives add up, a part of variable length adds to the parts
around it, a repeated part of variable length multiplies by its count.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from edge.serve.schema.enums import gbnf_literal
from edge.serve.schema.merge import Refused
from edge.serve.schema.repeat import MAX_REPEAT, repeat
from edge.serve.schema.stacks import leaf

try:  # Python 3.11+
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

__all__ = ["MAX_PATTERN_GROUP_DEPTH", "pattern_gbnf"]

MAX_PATTERN_GROUP_DEPTH = 64
_TOP = 0x10FFFF
_UNIVERSE = [(0, 0xD7FF), (0xE000, _TOP)]  # code points (no surrogates: UTF-8 cannot write them)
_ASCII = [(0, 0x7F)]
_SHORT = {0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", 0x22: '\\"', 0x5C: "\\\\"}


def _ascii_set(rx: str) -> list[tuple[int, int]]:
    return _ranges([c for c in range(128) if re.fullmatch(rx, chr(c))])


def _ranges(codes: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for c in sorted(set(codes)):
        if out and out[-1][1] + 1 == c:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


_CATEGORIES = {name: _ascii_set(rx) for name, rx in (
    ("CATEGORY_DIGIT", r"\d"), ("CATEGORY_NOT_DIGIT", r"\D"), ("CATEGORY_WORD", r"\w"),
    ("CATEGORY_NOT_WORD", r"\W"), ("CATEGORY_SPACE", r"\s"), ("CATEGORY_NOT_SPACE", r"\S"))}


def _union(sets: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(r for s in sets for r in s):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _minus(whole: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in whole:
        for c_lo, c_hi in cut:
            if c_hi < lo or c_lo > hi:
                continue
            if c_lo > lo:
                out.append((lo, c_lo - 1))
            lo = c_hi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


@dataclass
class _P:
    text: str
    stacks: int
    nullable: bool
    fixed: bool  # read one way only, of one length in characters


class _Reader:
    def __init__(self, conv: Any, where: str) -> None:
        self.conv, self.where = conv, where

    def refuse(self, why: str) -> Refused:
        return Refused(self.where, why)

    def charset(self, codes: list[tuple[int, int]]) -> _P:
        """One character of `codes`, as JSON writes it."""
        codes = _minus(_union([codes]), [(0xD800, 0xDFFF)])
        raw = _minus(codes, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
        alts = []
        if raw:
            alts.append("[" + "".join(f"\\U{lo:08X}" + (f"-\\U{hi:08X}" if hi > lo else "") for lo, hi in raw) + "]")
        for lo, hi in _minus(codes, raw):
            alts += [gbnf_literal(_SHORT.get(c, f"\\u{c:04x}")) for c in range(lo, hi + 1)]
        if not alts:
            raise self.refuse("a class of no character a JSON string can hold")
        return _P(alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")", 1, False, True)

    def in_class(self, items: list[Any]) -> list[tuple[int, int]]:
        negate = any(op.name == "NEGATE" for op, _ in items)
        sets, approximate = [], False
        for op, av in items:
            if op.name == "LITERAL":
                sets.append([(av, av)])
            elif op.name == "RANGE":
                sets.append([av])
            elif op.name == "CATEGORY":
                sets.append(_CATEGORIES[av.name] if av.name in _CATEGORIES else self._unknown(av.name))
                approximate = True
            elif op.name != "NEGATE":
                raise self.refuse(f"{op.name.lower()} in a class is not supported")
        codes = _union(sets)
        if negate:  # a class with \\d in it is known only within ASCII: its complement there
            codes = _minus(_ASCII if approximate else _UNIVERSE, codes)
        return codes

    def _unknown(self, name: str) -> list[tuple[int, int]]:
        raise self.refuse(f"the class item {name.lower()} is not supported")

    def item(self, op: Any, av: Any, depth: int) -> _P:
        name = op.name
        if name == "LITERAL" and 0xD800 <= av <= 0xDFFF:
            raise self.refuse(f"\\u{av:04x} is half of a UTF-16 surrogate pair, not a character: Python's re (and "
                              "so JSON Schema validators in Python) matches characters, and a JSON string's "
                              "text is UTF-8; write the character itself, or \\U followed by its 8 hex digits")
        if name == "LITERAL":
            return _P(gbnf_literal(json.dumps(chr(av), ensure_ascii=False)[1:-1]), 1, False, True)
        if name == "NOT_LITERAL":
            return self.charset(_minus(_UNIVERSE, [(av, av)]))
        if name == "ANY":
            return self.charset(_minus(_UNIVERSE, [(10, 10)]))
        if name == "IN":
            return self.charset(self.in_class(av))
        if name == "SUBPATTERN":
            if av[1] & re.IGNORECASE:
                raise self.refuse("case-insensitive groups are not supported: write both cases in a class")
            if depth >= MAX_PATTERN_GROUP_DEPTH:
                raise self.refuse(f"groups nest more than {MAX_PATTERN_GROUP_DEPTH} deep")
            inner = self.sequence(av[3], depth + 1)
            return _P(f"({inner.text})", inner.stacks, inner.nullable, inner.fixed)
        if name == "BRANCH":
            alts = [self.sequence(b, depth + 1) for b in av[1]]
            return _P("(" + " | ".join(a.text for a in alts) + ")", sum(a.stacks for a in alts),
                      any(a.nullable for a in alts), False)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            return self.repeat(*av, depth)
        why = {"AT": "anchors other than ^ at the start and $ at the end", "GROUPREF": "back-references",
               "ASSERT": "lookarounds", "ASSERT_NOT": "lookarounds", "GROUPREF_EXISTS": "conditionals",
               "ATOMIC_GROUP": "atomic groups", "POSSESSIVE_REPEAT": "possessive repetitions"}
        raise self.refuse(f"{why.get(name, name.lower())} are not supported in a pattern")

    def repeat(self, lo: int, hi: int, body: Any, depth: int) -> _P:
        top = None if hi == _sre.MAXREPEAT else hi
        if max(lo, top or 0) > MAX_REPEAT:
            raise self.refuse(f"asks for {max(lo, top or 0)} copies of one part, more than the {MAX_REPEAT} "
                              "a grammar for the model's output is built for")
        inner = self.sequence(body, depth + 1)
        if inner.nullable and (top is None or top > 1):
            raise self.refuse("a repeated part can match nothing (like (a?)* or (a|)*): each repetition "
                              "could be empty, so the grammar would keep a stack per reading; make the "
                              "part non-empty")
        text, mult = repeat(self.conv, self.conv.rule(inner.text, leaf(inner.stacks)), lo, top)
        spread = 1 if inner.fixed else (top if top is not None else lo + 1)
        return _P(f"({text})", inner.stacks * spread * mult, lo == 0 or inner.nullable,
                  inner.fixed and lo == top)

    def sequence(self, sub: Any, depth: int) -> _P:
        parts = [self.item(op, av, depth) for op, av in sub]
        if not parts:
            return _P('""', 1, True, True)
        fixed = [p.stacks for p in parts if p.fixed]
        stacks = sum(p.stacks for p in parts if not p.fixed) + max(fixed, default=0)
        return _P(" ".join(p.text for p in parts), max(stacks, 1), all(p.nullable for p in parts),
                  all(p.fixed for p in parts))


def _at(item: Any, kind: str) -> bool:
    op, av = item
    return op.name == "AT" and av.name in (kind, kind + "_STRING")


def pattern_gbnf(conv: Any, pattern: Any, where: str) -> tuple[str, int]:
    """GBNF for the JSON text (between the quotes) of the strings `pattern` matches, and its
    stack estimate; Refused naming `where`."""
    if not isinstance(pattern, str):
        raise Refused(where, "pattern must be a string")
    try:
        parsed = _sre.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise Refused(where, f"not a regular expression Python's re reads: {exc}") from None
    if parsed.state.flags & re.IGNORECASE:
        raise Refused(where, "case-insensitive patterns are not supported: write both cases in a class")
    items = list(parsed)
    if len(items) < 2 or not (_at(items[0], "AT_BEGINNING") and _at(items[-1], "AT_END")):
        raise Refused(where, "the pattern must be anchored at both ends (^...$): the grammar writes the "
                      "whole string")
    body = _Reader(conv, where).sequence(items[1:-1], 0)
    return body.text, body.stacks
