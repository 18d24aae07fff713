"""Proofs that two schemas share no value, so that a `oneOf` means exactly one.

A grammar can write a union, not "exactly one of": an output of one alternative that another
alternative also accepts breaks `oneOf`. So edge accepts a `oneOf` only where it can prove that
no JSON value matches two of its alternatives, reading each alternative as the `jsonschema`
validator reads it (not as the grammar writes it: `{"minimum": 5}` holds for every string, so it
overlaps `{"type": "string"}` though its grammar writes integers). Two schemas are disjoint where:
- their kinds (edge.serve.schema.values: the types, with `integer` and `fraction` the halves of
  `number`) do not meet;
- one is a list of values (`enum`, `const`) of which none can match the other (a different
  value, compared as JSON values: 1 == 1.0, 0 == -0.0, objects by value; a value of another
  kind; one its lengths, bounds or required names rule out: no client regex is run);
- each alternative of one (`anyOf`/`oneOf`) is disjoint from the other;
- within every kind both allow, they part: strings by lengths that do not overlap, integers by
  ranges, arrays by item counts or a position both require with disjoint item schemas, objects by
  a property both require with disjoint schemas (a discriminator: `"kind": {"const": "a"}`).
Anything else is "may overlap", and the oneOf is refused (400) naming both alternatives.
"""

from __future__ import annotations

from typing import Any

from edge.serve.schema.merge import MAX_MERGE_DEPTH, flatten, pointer, type_set
from edge.serve.schema.ranges import NoInteger, integer_bounds
from edge.serve.schema.values import KINDS, json_key, kind, kinds_of_types, outside

__all__ = ["MAX_STEPS", "disjoint"]

_INF = float("inf")
MAX_STEPS = 10_000  # comparisons one proof may make (required properties nest: their product could be huge)


class _Prover:
    def __init__(self, root: Any, where: str) -> None:
        self.root, self.where = root, where
        self.steps = MAX_STEPS  # past them, "may overlap": the oneOf is refused, never a wrong proof
        # id of a schema -> (the schema, kept alive so that its id is not reused; its enum's values as
        # json_key): asked once per value of the other side
        self._keys: dict[int, tuple[Any, set[Any]]] = {}

    def flat(self, s: Any, depth: int) -> Any:
        """`s` flattened, a lone `$ref` followed (None past the depth bound: no proof)."""
        for _ in range(MAX_MERGE_DEPTH - depth):
            s = flatten(s, self.where, self.root)
            if not (isinstance(s, dict) and set(s) == {"$ref"}):
                return s
            s = pointer(self.root, s["$ref"], self.where)
        return None

    def kinds(self, s: Any, depth: int) -> frozenset[str]:
        if s is False:
            return frozenset()
        if not isinstance(s, dict) or depth > MAX_MERGE_DEPTH:
            return KINDS
        alts = s.get("anyOf") or s.get("oneOf")
        if alts is not None:
            return frozenset().union(*(self.kinds(self.flat(a, depth + 1), depth + 1) for a in alts))
        if "enum" in s:
            return frozenset(kind(v) for v in s["enum"])
        return kinds_of_types(type_set(s, self.where))

    def values(self, s: Any, depth: int) -> list[Any] | None:
        """The values `s` allows where they are a finite list (None: not known to be)."""
        if s is False:
            return []
        if not isinstance(s, dict) or depth > MAX_MERGE_DEPTH:
            return None
        alts = s.get("anyOf") or s.get("oneOf")
        if alts is not None:
            each = [self.values(self.flat(a, depth + 1), depth + 1) for a in alts]
            return None if any(v is None for v in each) else [v for vs in each for v in vs]  # type: ignore[union-attr]
        return list(s["enum"]) if "enum" in s else None

    def apart(self, a: Any, b: Any, depth: int) -> bool:
        """Whether no JSON value matches both (flattened) schemas."""
        self.steps -= 1
        if a is None or b is None or depth > MAX_MERGE_DEPTH or self.steps < 0:
            return False
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False  # `true` (or {}) meets everything that is not empty
        ka, kb = self.kinds(a, depth), self.kinds(b, depth)
        both = ka & kb
        if not both:
            return True
        for x, kx, y, ky in ((a, ka, b, kb), (b, kb, a, ka)):
            vx = self.values(x, depth)
            if vx is not None and all(self.rules_out(y, ky, v, depth) for v in vx):
                return True
            alts = x.get("anyOf") or x.get("oneOf")
            if alts is not None and all(self.apart(self.flat(alt, depth + 1), y, depth + 1) for alt in alts):
                return True
        return all(self.within(k, a, b, depth) for k in both)

    def rules_out(self, s: Any, kinds: frozenset[str], value: Any, depth: int) -> bool:
        """Whether `value` provably fails the flattened schema `s` (of kinds `kinds`)."""
        if s is False:
            return True
        if not isinstance(s, dict) or depth > MAX_MERGE_DEPTH:
            return False
        alts = s.get("anyOf") or s.get("oneOf")
        if alts is not None:
            flats = [self.flat(alt, depth + 1) for alt in alts]
            return all(f is not None and self.rules_out(f, self.kinds(f, depth + 1), value, depth + 1)
                       for f in flats)
        if "enum" not in s:
            return outside(value, s, kinds)
        if id(s) not in self._keys:
            self._keys[id(s)] = (s, {json_key(v) for v in s["enum"]})
        return outside(value, s, kinds, self._keys[id(s)][1])

    def within(self, k: str, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        """Whether no value of kind `k` matches both."""
        if "anyOf" in a or "oneOf" in a or "anyOf" in b or "oneOf" in b:
            return False
        if k == "string":
            return _ranges_apart(_span(a, "minLength", "maxLength"), _span(b, "minLength", "maxLength"))
        if k == "integer":
            return _ranges_apart(_integers(a), _integers(b))
        if k == "array":
            return (_ranges_apart(_span(a, "minItems", "maxItems"), _span(b, "minItems", "maxItems"))
                    or any(self.apart(self.flat(_item(a, i), depth + 1), self.flat(_item(b, i), depth + 1), depth + 1)
                           for i in range(min(a.get("minItems", 0), b.get("minItems", 0), 64))))
        if k == "object":
            common = [r for r in a.get("required", ()) if r in b.get("required", ())]
            return any(self.apart(self.flat(_member(a, r), depth + 1), self.flat(_member(b, r), depth + 1), depth + 1)
                       for r in common)
        return False


def _span(s: dict[str, Any], lo: str, hi: str) -> tuple[float, float]:
    return s.get(lo, 0), s.get(hi, _INF)


def _integers(s: dict[str, Any]) -> tuple[float, float] | None:
    try:
        lo, hi = integer_bounds(s)
    except NoInteger:
        return None  # no integer at all
    except ValueError:
        return -_INF, _INF
    return (-_INF if lo is None else lo), (_INF if hi is None else hi)


def _ranges_apart(x: tuple[float, float] | None, y: tuple[float, float] | None) -> bool:
    return x is None or y is None or x[1] < y[0] or y[1] < x[0]


def _item(s: dict[str, Any], i: int) -> Any:
    prefix = s.get("prefixItems") or []
    return prefix[i] if i < len(prefix) else s.get("items", True)


def _member(s: dict[str, Any], name: str) -> Any:
    return (s.get("properties") or {}).get(name, s.get("additionalProperties", True))


def disjoint(a: Any, b: Any, root: Any, where: str) -> bool:
    """Whether edge can prove that no JSON value matches both schemas (as parts of `root`)."""
    p = _Prover(root, where)
    return p.apart(p.flat(a, 0), p.flat(b, 0), 0)
