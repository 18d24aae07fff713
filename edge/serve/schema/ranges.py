"""An integer range as a grammar: the decimal integers from lo to hi, exactly, for a JSON schema's
`minimum`, `maximum`, `exclusiveMinimum` and `exclusiveMaximum` on `"type": "integer"`.

llama-cpp-python's converter drops these keywords (its integer is any run of up to 16 digits);
llama.cpp's C++ converter builds ranges digit by digit, and so does this module, in its own way:
the integers of one length between two bounds are, by their first digit, the ones that share the
low bound's first digit (recursing on the rest), those whose first digit lies strictly between
(any digits after), and those that share the high bound's. No leading zeros and no `-0`, as JSON
writes integers. A side left open goes to 16 digits (or the other bound's length, if longer),
the converter's own limit for an integer.

The range is a small tree rendered twice: as GBNF for llama.cpp, and as a Python regex, which
the tests compare with `lo <= n <= hi` (tests/serve/test_schemarange.py).
"""

from __future__ import annotations

import math
import re
from typing import Union

__all__ = ["MAX_BOUND_DIGITS", "OPEN_DIGITS", "NoInteger", "integer_bounds", "range_gbnf", "range_regex", "range_tree"]

OPEN_DIGITS = 16  # an open side: up to this many digits, as the converter's integer
MAX_BOUND_DIGITS = 40  # a bound with more digits than this is refused



class NoInteger(ValueError):
    """Bounds that no integer meets."""


# a node: a literal str, ("cls", lo, hi) one digit, ("rep", node, k) k copies,
# ("seq", [nodes]), ("alt", [nodes])
Node = Union[str, tuple]


def _cls(a: int | str, b: int | str) -> Node:
    return str(a) if str(a) == str(b) else ("cls", str(a), str(b))


def _alt(nodes: list[Node]) -> Node:
    return nodes[0] if len(nodes) == 1 else ("alt", nodes)


def _any(k: int) -> list[Node]:
    return [("rep", ("cls", "0", "9"), k)] if k else []


def _same_length(x: str, y: str) -> list[Node]:
    """Alternatives matching every digit string s with len(s) == len(x) and x <= s <= y."""
    if x == y:
        return [x]
    if len(x) == 1:
        return [_cls(x, y)]
    k = len(x) - 1
    if x[0] == y[0]:
        return [("seq", [x[0], _alt(_same_length(x[1:], y[1:]))])]
    out: list[Node] = []
    first = int(x[0])
    if x[1:] != "0" * k:  # the low bound's first digit, then its rest up to all nines
        out.append(("seq", [x[0], _alt(_same_length(x[1:], "9" * k))]))
        first += 1
    last = int(y[0]) - (y[1:] != "9" * k)
    if first <= last:
        out.append(("seq", [_cls(first, last), *_any(k)]))
    if y[1:] != "9" * k:
        out.append(("seq", [y[0], _alt(_same_length("0" * k, y[1:]))]))
    return out


def _non_negative(a: int, b: int) -> list[Node]:
    out: list[Node] = []
    for length in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (length - 1) if length > 1 else 0), min(b, 10**length - 1)
        if lo <= hi:
            out += _same_length(str(lo), str(hi))
    return out


def range_tree(lo: int | None, hi: int | None) -> Node:
    """The integers lo..hi (None: open on that side); lo <= hi."""
    width = max([OPEN_DIGITS, *(len(str(abs(v))) for v in (lo, hi) if v is not None)])
    lo = -(10**width - 1) if lo is None else lo
    hi = 10**width - 1 if hi is None else hi
    alts: list[Node] = []
    if lo < 0:
        alts.append(("seq", ["-", _alt(_non_negative(max(1, -hi), -lo))]))
    if hi >= 0:
        alts += _non_negative(max(0, lo), hi)
    return _alt(alts)


def range_gbnf(node: Node) -> str:
    if isinstance(node, str):
        return f'"{node}"'
    kind, *rest = node
    if kind == "cls":
        return f"[{rest[0]}-{rest[1]}]"
    if kind == "rep":
        return f"{range_gbnf(rest[0])}{{{rest[1]}}}"
    if kind == "seq":
        return " ".join(range_gbnf(n) for n in rest[0])
    return "(" + " | ".join(range_gbnf(n) for n in rest[0]) + ")"


def range_regex(node: Node) -> str:
    if isinstance(node, str):
        return re.escape(node)
    kind, *rest = node
    if kind == "cls":
        return f"[{rest[0]}-{rest[1]}]"
    if kind == "rep":
        return f"{range_regex(rest[0])}{{{rest[1]}}}"
    if kind == "seq":
        return "".join(range_regex(n) for n in rest[0])
    return "(?:" + "|".join(range_regex(n) for n in rest[0]) + ")"


def _number(schema: dict, key: str) -> float | None:
    v = schema.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and key.startswith("exclusive"):
        plain = key[9].lower() + key[10:]
        raise ValueError(f"{str(v).lower()} is draft 4's form: in JSON Schema 2020-12, {key} is the bound itself "
                         f"(write \"{key}\": N where draft 4 had \"{plain}\": N and \"{key}\": true)")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number")
    if abs(v) >= 10**MAX_BOUND_DIGITS:
        raise ValueError(f"{key} has more than {MAX_BOUND_DIGITS} digits")
    return v


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """(lo, hi) of an integer schema's minimum/maximum/exclusiveMinimum/exclusiveMaximum (2020-12:
    each a number); ValueError naming the keyword for a bound that is not one, NoInteger for
    bounds no integer meets."""
    lo_f, hi_f = _number(schema, "minimum"), _number(schema, "maximum")
    ex_lo, ex_hi = _number(schema, "exclusiveMinimum"), _number(schema, "exclusiveMaximum")
    lo = None if lo_f is None else math.ceil(lo_f)
    hi = None if hi_f is None else math.floor(hi_f)
    if ex_lo is not None:
        lo = max(lo, math.floor(ex_lo) + 1) if lo is not None else math.floor(ex_lo) + 1
    if ex_hi is not None:
        hi = min(hi, math.ceil(ex_hi) - 1) if hi is not None else math.ceil(ex_hi) - 1
    if lo is not None and hi is not None and lo > hi:
        raise NoInteger(f"no integer is between the bounds ({lo} > {hi})")
    return lo, hi
