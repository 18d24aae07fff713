"""JSON values as JSON Schema compares them, for a schema's `enum`/`const` and the oneOf proofs.

- Equal as JSON values (`json_key`): numbers by their value (1 == 1.0, 0 == -0.0), objects by
  their members whatever the key order, `true` never equal to 1 (Python's `True == 1`).
- Kinds (`kind`): the JSON Schema types a value can have, with `integer` and `fraction` as the
  two halves of `number` (2.0 is an integer, as JSON Schema 2020-12 counts it).
- Only JSON (`not_json`): Python's `json` reads `NaN`, `Infinity` and `1e400` (an infinite float)
  in a request body; none is a JSON value, and an enum or const holding one would make the
  grammar write `NaN` or `Infinity`, so the keyword is refused, naming the value's path.
- Outside a schema (`outside`): whether a value provably fails a (flattened) schema's own
  keywords (lengths, counts, bounds, required names), read the way the `jsonschema` validator
  reads them; "may be inside" where a keyword is not one this reads (the proofs that use it then
  fail safe: a oneOf is refused).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["KINDS", "json_key", "kind", "kinds_of_types", "not_json", "outside"]

KINDS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
_OF_TYPE = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
            "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"}}


def json_key(value: Any) -> Any:
    """A hashable key, equal for two values exactly when JSON Schema calls them equal."""
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, (int, float)):
        return ("number", value)  # 1 == 1.0 == True aside: bools are caught above
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(json_key(v) for v in value))
    return ("object", frozenset((k, json_key(v)) for k, v in value.items()))


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    if isinstance(value, float):
        return "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def kinds_of_types(types: set[str] | None) -> frozenset[str]:
    """The kinds a `type` allows (None: no `type`, every kind)."""
    if types is None:
        return KINDS
    return frozenset().union(*(_OF_TYPE[t] for t in types))


def not_json(value: Any, path: str = "") -> str | None:
    """The path (`[2]`, `.a[0]`) of the first number in `value` that JSON cannot write (NaN,
    an infinity); None when it is all JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "<value>"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = not_json(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}")
        if found is not None:
            return found
    return None


def _length_outside(v: Any, s: dict[str, Any]) -> bool:
    n = len(v)
    lo, hi = (s.get("minLength"), s.get("maxLength")) if isinstance(v, str) else (s.get("minItems"), s.get("maxItems"))
    return (lo is not None and n < lo) or (hi is not None and n > hi)


def _number_outside(v: Any, s: dict[str, Any]) -> bool:
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    return ((lo is not None and v < lo) or (hi is not None and v > hi)
            or (xlo is not None and v <= xlo) or (xhi is not None and v >= xhi))


def outside(value: Any, s: Any, kinds: frozenset[str], values: set[Any] | None = None) -> bool:
    """Whether `value` provably fails the flattened schema `s`, whose kinds are `kinds`: its kind
    is not one of them, it is not one of `s`'s enum values, or it breaks one of `s`'s lengths,
    counts, bounds or required names. False where this cannot tell (a `pattern` is never run on a
    value: a client's regex can take exponential time in Python's `re`). `values`: the json_key
    set of `s`'s enum, where the caller keeps it."""
    if s is False:
        return True
    if not isinstance(s, dict):
        return False
    k = kind(value)
    if k not in kinds:
        return True
    if "enum" in s and json_key(value) not in (values if values is not None else {json_key(v) for v in s["enum"]}):
        return True
    if k in ("string", "array") and _length_outside(value, s):
        return True
    if k in ("integer", "fraction") and _number_outside(value, s):
        return True
    return k == "object" and any(isinstance(r, str) and r not in value for r in s.get("required", ()))
