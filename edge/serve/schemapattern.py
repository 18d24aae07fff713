"""A JSON schema's `pattern`, read the way llama-cpp-python's schema converter will read it
(`SchemaConverter._visit_pattern`), before the converter sees it.

The converter scans the pattern once, left to right: `.`, `(`...`)` (no `(?`), `[`...`]` (a `\\`
takes the next character with it), `|`, `*` `+` `?`, and `{...}`: everything up to the next `}`,
split at `,`, each part stripped and read by `int()`. So it reads `{,20000}`, `{0,+20000}`,
`{+5}`, `{20_000}` and `{ 5 }` as repetitions, where the pattern's own language (ECMA-262, and
Python's `re`) reads the last four as literal text; it writes `{n,m}` out as n copies and m-n
nested optional groups; it loops forever on a `}` or `]` outside a quantifier or class; and it
writes `{5,3}` as five copies. This module walks the pattern with the converter's own steps and
refuses (400, naming the field) what the converter would misread, loop on, or write out past the
bounds, so a pattern either means to the grammar what it means to `re`, or is refused.

`read_pattern` answers the repetitions found (`Repeat`, in the order `re`'s parser lists them)
and the most copies of one atom the converter writes (nested repetitions multiply);
tests/serve/test_schemapattern.py fuzzes both against `re`'s own parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edge.errors import RequestError

__all__ = ["MAX_PATTERN_GROUP_DEPTH", "MAX_REPEAT", "PatternRead", "Repeat", "read_pattern"]

MAX_REPEAT = 10_000  # copies of one atom a pattern (or minLength/maxItems...) may ask for
MAX_PATTERN_GROUP_DEPTH = 64  # groups inside groups, like JSON's nesting limit

# what re (and ECMA-262) read as a repetition: digits only, `{n}`, `{n,}`, `{,m}`, `{n,m}`, `{,}`
_QUANTIFIER = re.compile(r"\{(\d*),(\d*)\}|\{(\d+)\}")
_NON_LITERAL = set("|.()[]{}*+?")  # the converter's NON_LITERAL_SET
_CONVERTED_ESCAPES = set("[]()|{}*+?")  # the converter writes these as the bare character
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}  # in a class, as llama.cpp's grammar parser reads them


@dataclass(frozen=True)
class Repeat:
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True)
class PatternRead:
    repeats: tuple[Repeat, ...]
    copies: int  # the most copies of one atom the converter writes out
    depth: int  # groups inside groups


def _copies(r: Repeat) -> int:
    """How many copies of its atom the converter writes for one repetition (an unbounded tail is
    one looping rule)."""
    return max(1, r.hi if r.hi is not None else r.lo)


class _Reader:
    def __init__(self, pattern: str, where: str, param: str) -> None:
        self.p, self.where, self.param = pattern, where, param
        self.repeats: list[tuple[int, Repeat]] = []  # (start of its atom, repeat): re's order
        self.depth = self.deepest = 0

    def refuse(self, why: str) -> RequestError:
        return RequestError(f"{self.where}: {why}", param=self.param)

    def quantifier(self, i: int) -> tuple[Repeat, int]:
        """The `{...}` at i, as the converter reads it: up to the next `}`."""
        end = self.p.find("}", i)
        if end < 0:
            raise self.refuse(f"unbalanced '{{' at index {i} of /{self.p}/")
        text = self.p[i:end + 1]
        m = _QUANTIFIER.fullmatch(text)
        if not m:
            raise self.refuse(f"{text!r} at index {i} is not a repetition the pattern's language "
                              "reads (it is literal text there), but llama.cpp's converter would read "
                              "it as one: write {n}, {n,}, {,m} or {n,m} with plain digits, or \\{ for a brace")
        if m[3] is not None:
            r = Repeat(int(m[3]), int(m[3]))
        else:
            r = Repeat(int(m[1]) if m[1] else 0, int(m[2]) if m[2] else None)
        if r.hi is not None and r.lo > r.hi:
            raise self.refuse(f"{text} at index {i}: the minimum is more than the maximum")
        return r, end + 1

    def escape(self, i: int, in_class: bool) -> None:
        """An escape llama.cpp's grammar parser knows once the converter has copied it: outside a
        class only the converter's own (\\( \\{ \\* ...), which it writes as the character; in
        a class also \\x \\u \\U with their hex digits, \\t \\n \\r."""
        e = self.p[i + 1:i + 2]
        if in_class and e in _HEX_DIGITS:
            digits = self.p[i + 2:i + 2 + _HEX_DIGITS[e]]
            if len(digits) == _HEX_DIGITS[e] and all(c in "0123456789abcdefABCDEF" for c in digits):
                return
        elif e in _CONVERTED_ESCAPES or in_class and e in "trn[]":
            return
        hint = {"d": "[0-9]", "w": "[a-zA-Z0-9_]", "s": "[ ]", ".": "[.]"}.get(e, "the character itself, or a class")
        raise self.refuse(f"the escape \\{e} at index {i} is not supported here by llama.cpp's converter; write {hint}")

    def literal(self, i: int) -> tuple[int, int]:
        """The converter's literal loop at i: (characters it takes, index after them). A plain
        character joins only where no repetition follows it; an escape or a quote always joins."""
        p, n = self.p, 0
        while i < len(p):
            if p[i] == "\\":
                if i == len(p) - 1:
                    raise self.refuse(f"a backslash at the pattern's end (index {i}) escapes nothing")
                self.escape(i, False)
                i += 2
            elif p[i] == '"':
                raise self.refuse(f"a '\"' at index {i}: llama.cpp's converter would write it into the "
                                  "JSON string unescaped, which is not valid JSON")
            elif p[i] not in _NON_LITERAL and (
                    i == len(p) - 1 or n == 0 or p[i + 1] == "." or p[i + 1] not in _NON_LITERAL):
                if p[i] in "^$":
                    raise self.refuse(f"{p[i]!r} at index {i}: anchors are supported only at both ends "
                                      "(llama.cpp's converter would read it as the character)")
                i += 1
            else:
                break
            n += 1
        if n == 0:  # the converter would loop here forever
            raise self.refuse(f"unbalanced {p[i]!r} at index {i} of /{p}/ (escape it: \\{p[i]})")
        return n, i

    def group(self, i: int) -> tuple[int, int]:
        if self.p[i + 1:i + 2] == "?":
            raise self.refuse(f"'(?' at index {i}: lookarounds, non-capturing and named groups are "
                              "not supported by llama.cpp's converter")
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        if self.depth > MAX_PATTERN_GROUP_DEPTH:
            raise self.refuse(f"groups nest more than {MAX_PATTERN_GROUP_DEPTH} deep")
        end, inside = self.sequence(i + 1, True)
        self.depth -= 1
        return end, inside

    def char_class(self, i: int) -> int:
        p, start = self.p, i
        i += 1
        while i < len(p) and p[i] != "]":
            if p[i] == "\\":
                self.escape(i, True)
            i += 2 + _HEX_DIGITS.get(p[i + 1:i + 2], 0) if p[i] == "\\" else 1
        if i >= len(p):
            raise self.refuse(f"unbalanced '[' at index {start} of /{p}/")
        return i + 1

    def repeat(self, i: int, atom: tuple[int, int, int] | None) -> tuple[Repeat, int]:
        p, c = self.p, self.p[i]
        if atom is None:
            raise self.refuse(f"{c!r} at index {i} repeats nothing")
        if atom[2] > 1:
            raise self.refuse(f"{c!r} at index {i}: llama.cpp's converter would repeat "
                              f"{p[atom[0]:i]!r} where the pattern repeats only its last character; "
                              "put that character in a group")
        if c == "{":
            r, i = self.quantifier(i)
        else:
            r, i = Repeat(*{"*": (0, None), "+": (1, None), "?": (0, 1)}[c]), i + 1
        if i < len(p) and p[i] in "*+?{":  # a{2}{3}, a*?: the converter reads these otherwise
            raise self.refuse(f"{p[i]!r} at index {i} follows another repetition")
        return r, i

    def sequence(self, i: int, nested: bool) -> tuple[int, int]:
        """Read from i to the end of this group; (index after it, most copies inside it)."""
        p, most = self.p, 1
        atom: tuple[int, int, int] | None = None  # (start, copies inside, characters) of the last one
        while i < len(p):
            c, start = p[i], i
            if c == ")":
                if not nested:
                    raise self.refuse(f"unbalanced ')' at index {i} of /{p}/")
                return i + 1, most
            if c == "(":
                i, inside = self.group(i)
                atom, most = (start, inside, 1), max(most, inside)
            elif c == "[":
                atom, i = (start, 1, 1), self.char_class(i)
            elif c == ".":
                atom, i = (start, 1, 1), i + 1
            elif c in "*+?{":
                r, i = self.repeat(i, atom)
                self.repeats.append((atom[0], r))  # type: ignore[index]
                most = max(most, atom[1] * _copies(r))  # type: ignore[index]
                atom = None
            elif c == "|":
                atom, i = None, i + 1
            else:
                n, i = self.literal(i)
                atom = (start, 1, n)
        if nested:
            raise self.refuse(f"unbalanced '(' in /{p}/")
        return i, most


def read_pattern(pattern: str, where: str, param: str) -> PatternRead:
    """The repetitions of a schema `pattern` and the copies they make; a 400 naming `where` for
    what llama.cpp's converter would misread, loop on, or write out past MAX_REPEAT copies."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or len(pattern) < 2:
        raise RequestError(f"{where}: llama.cpp's converter needs a pattern anchored at both ends "
                           "(^...$)", param=param)
    reader = _Reader(pattern[1:-1], where, param)
    _, copies = reader.sequence(0, False)
    if copies > MAX_REPEAT:
        raise reader.refuse(f"asks for {copies} copies of one part, more than the {MAX_REPEAT} "
                            "a grammar for the model's output is built for")
    repeats = tuple(r for _, r in sorted(reader.repeats, key=lambda sr: sr[0]))
    return PatternRead(repeats, copies, reader.deepest)


# What a JSON string may not hold unescaped: the converter's `.` ([^\n\r]) and classes let the
# model write them raw (`"a"b"`: not JSON). json_safe() takes them out of every `.` and class.
_JSON_BAD = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_SAFE_ANY = '[^"\\\\\\x00-\\x1F]'  # pattern text: [^"\\\x00-\x1F]


def _class_chars(body: str) -> list[int]:
    """The code points a class body's items name in order (escapes read), for ranges."""
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\":
            e = body[i + 1]
            n = _HEX_DIGITS.get(e, 0)
            out.append(int(body[i + 2:i + 2 + n], 16) if n else {"t": 9, "n": 10, "r": 13}.get(e, ord(e)))
            i += 2 + n
        else:
            out.append(ord(body[i]) if body[i] != "-" or i in (0, len(body) - 1) else -1)  # -1: a range's dash
            i += 1
    return out


def _safe_class(body: str, where: str, param: str) -> str:
    """A positive class without what JSON must escape, as \\U ranges."""
    items, ranges = _class_chars(body), []
    k = 0
    while k < len(items):
        if k + 2 < len(items) and items[k + 1] == -1:
            ranges.append((items[k], items[k + 2]))
            k += 3
        else:
            ranges.append((items[k], items[k]) if items[k] != -1 else (45, 45))
            k += 1
    for lo_bad, hi_bad in _JSON_BAD:
        ranges = [piece for lo, hi in ranges for piece in ((lo, min(hi, lo_bad - 1)), (max(lo, hi_bad + 1), hi))
                  if piece[0] <= piece[1]]
    if not ranges:
        raise RequestError(f"{where}: the class [{body}] holds only characters a JSON string must escape "
                           "(quote, backslash, control characters), which the grammar cannot write", param=param)
    return "[" + "".join(f"\\U{lo:08X}" + (f"-\\U{hi:08X}" if hi > lo else "") for lo, hi in ranges) + "]"


def json_safe(pattern: str, where: str = "pattern", param: str = "pattern") -> str:
    """`pattern` (read_pattern accepted it) with every `.` and class unable to match a quote, a
    backslash or a control character, which would reach the JSON string unescaped."""
    out, i, p = [], 0, pattern
    while i < len(p):
        c = p[i]
        if c == "\\":
            out.append(p[i:i + 2])
            i += 2
        elif c == "." and 0 < i < len(p) - 1:
            out.append(_SAFE_ANY)
            i += 1
        elif c == "[":
            j = i + 1
            while p[j] != "]":
                j += 2 + _HEX_DIGITS.get(p[j + 1], 0) if p[j] == "\\" else 1
            body = p[i + 1:j]
            out.append(f'[{body}"\\\\\\x00-\\x1F]' if body.startswith("^") else _safe_class(body, where, param))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)
