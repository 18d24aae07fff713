"""Random and adversarial JSON schemas for tests/serve/test_schemaproperty.py: every keyword of
edge's table (KEYWORDS) that is enforced, in nestings, through `$ref`s (named like edge's own
rules once were: `space`, `string`, `root`...), with the names, values and patterns that broke
the earlier converter (control characters, quotes, backslashes, non-ASCII, astral), and issue
56's: `allOf` and `$ref` with keywords beside it (closed objects, items against prefixItems,
bounds on both sides), `oneOf` without types or with values equal as JSON (1 and 1.0, 0 and
-0.0, objects in another key order), NaN and the infinities, `enum` beside `const`. `used` holds
the kinds of the last schema (a test counts what was accepted and refused per kind)."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["NAMES", "PATTERNS", "SchemaGen", "nested_any_of", "random_pattern"]

NAMES = ["a", "b", "ab", "abc", "name", "名前", 'x"y', "back\\slash", "tab\tname", "a b", "", "😀", "space"]
PATTERNS = [
    r"^[a-z]{2,8}-\d{1,3}$", r"^\d{3}-\d{4}$", r"^(foo|bar)+$", r'^[^"]*$', r"^a\.b$", r"^[\x00-\x7f]{1,4}$",
    r'^"\\$', r"^.{2,3}$", r"^\w+@\w+\.com$", r"^[A-Z][a-z]*( [A-Z][a-z]*)*$", r"^(\d+|x)$", r"^\s?\S+$",
    r"^[^a-z]{2}$", r"^名前\d$", r"^😀{1,2}$", r"^[\u00e9-\u00ff]+$", r"^(ab|a)(bc|c)$", r"^\D\W\S$",
    r"^[\t\n]x$", r"^a{0,3}b?$", r"^(?:x|y){2}z*$", r"^[-+]?\d+(\.\d+)?$",
]
_VALUES = [0, 1, -3, 2.5, "a", "名", 'q"', "b\\s", "\n", True, False, None, [], [1, "x"], {}, {"k": [None]}]
_DEF_NAMES = ["space", "string", "integral-part", "root", "value", "j-value", "x", "a/b", "t~n"]
_LEAVES = ["string", "strlen", "pattern", "format", "integer", "range", "number", "boolean", "null", "enum",
           "const", "typelist", "typed-enum", "empty", "enum-const", "allOf-bounds", "oneOf-values"]
_NODES = ["object", "object", "array", "tuple", "anyOf", "oneOf", "allOf", "ref", "typed-anyOf", "ref-siblings",
          "closed-ref", "allOf-array", "allOf-object", "oneOf-typeless", "oneOf-discriminated"]
ADVERSARIAL = ["nonfinite"]  # drawn now and then: always refused
_NONFINITE = [float("inf"), float("-inf"), float("nan")]


class SchemaGen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def schema(self) -> dict[str, Any]:
        """A whole schema: a root with its $defs."""
        self.defs: dict[str, Any] = {}
        self.used: set[str] = set()
        root = self.node(3)
        if self.defs:
            root = {**root, "$defs": self.defs} if "$ref" not in root else {"allOf": [root], "$defs": self.defs}
        return root

    def node(self, depth: int) -> dict[str, Any]:
        r = self.rng
        kind = r.choice(ADVERSARIAL) if r.random() < 0.02 else r.choice(_LEAVES + (_NODES * 2 if depth > 0 else []))
        self.used.add(kind)
        s = getattr(self, "_" + kind.replace("-", "_"))(depth - 1)
        if r.random() < 0.1:
            s = {**s, "title": "t", "description": "d"}
        return s

    def _string(self, d: int) -> dict:
        return {"type": "string"}

    def _strlen(self, d: int) -> dict:
        lo = self.rng.choice([0, 1, 2, 5])
        return {"type": "string", "minLength": lo, "maxLength": self.rng.choice([lo, lo + 2, 10_000])}

    def _pattern(self, d: int) -> dict:
        return {"type": "string", "pattern": self.rng.choice(PATTERNS)}

    def _format(self, d: int) -> dict:
        return {"type": "string", "format": self.rng.choice(["date", "time", "date-time", "uuid"])}

    def _integer(self, d: int) -> dict:
        return {"type": "integer"}

    def _range(self, d: int) -> dict:
        lo, r = self.rng.choice([-120, -1, 0, 7, 99]), self.rng.random()
        hi = lo + self.rng.choice([0, 3, 1000])
        if r < 0.3:
            return {"type": "integer", "exclusiveMinimum": lo - 0.5, "exclusiveMaximum": hi + 1}
        return {"type": "integer", "minimum": lo, "maximum": hi} if r < 0.8 else {"type": "integer", "minimum": lo}

    def _number(self, d: int) -> dict:
        return {"type": "number"}

    def _boolean(self, d: int) -> dict:
        return {"type": "boolean"}

    def _null(self, d: int) -> dict:
        return {"type": "null"}

    def _enum(self, d: int) -> dict:
        return {"enum": self.rng.sample(_VALUES, self.rng.randint(1, 5))}

    def _const(self, d: int) -> dict:
        return {"const": self.rng.choice(_VALUES)}

    def _typelist(self, d: int) -> dict:
        return {"type": self.rng.sample(["string", "integer", "null", "boolean", "number"], 2), "maxLength": 3}

    def _typed_enum(self, d: int) -> dict:
        return {"type": "string", "enum": ["a", 1, "b\n", None, "c"]}

    def _empty(self, d: int) -> dict:
        return {}

    def _object(self, d: int) -> dict:
        r = self.rng
        names = r.sample(NAMES, r.randint(0, 4))
        s: dict[str, Any] = {"type": "object", "properties": {n: self.node(d) for n in names}}
        s["required"] = [n for n in names if r.random() < 0.5] + (["zz"] if r.random() < 0.15 else [])
        extra = r.choice(["absent", False, True, "schema"])
        if extra == "schema":
            s["additionalProperties"] = self.node(d)
        elif extra != "absent":
            s["additionalProperties"] = extra
        return s

    def _array(self, d: int) -> dict:
        r = self.rng
        lo = r.choice([0, 0, 1, 2])
        s = {"type": "array", "items": self.node(d), "minItems": lo}
        if r.random() < 0.7:
            s["maxItems"] = r.choice([lo, lo + 1, 3, 10_000])
        return s

    def _tuple(self, d: int) -> dict:
        r = self.rng
        s: dict[str, Any] = {"type": "array", "prefixItems": [self.node(d) for _ in range(r.randint(1, 3))]}
        s["items"] = r.choice([False, self.node(d), True])
        s["minItems"] = r.randint(0, 2)
        return s

    def _anyOf(self, d: int) -> dict:
        return {"anyOf": [self.node(d) for _ in range(self.rng.randint(1, 3))]}

    def _oneOf(self, d: int) -> dict:
        kinds = self.rng.sample([{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "null"},
                                 {"type": "boolean"}, {"type": "object", "properties": {"k": self.node(d)}},
                                 {"type": "array", "items": self.node(d), "maxItems": 2}], 2)
        return {"oneOf": kinds}

    def _allOf(self, d: int) -> dict:
        r = self.rng
        a = {"type": "object", "properties": {"a": self.node(d), "b": {"type": "integer"}}, "required": ["a"]}
        b = {"properties": {"b": {"type": "integer", "minimum": 0}, "c": {"type": "boolean"}}, "required": ["c"]}
        return r.choice([{"allOf": [a, b]}, {"allOf": [self._ref(d), {"type": r.choice(["string", "object", "integer"])}]},
                         {"allOf": [{"anyOf": [self.node(d), {"type": "string"}]}, {"type": "string"}]},
                         {"allOf": [{"type": "string"}, {"maxLength": 2}]}])

    def _ref(self, d: int) -> dict:
        name = self.rng.choice(_DEF_NAMES)
        if name not in self.defs:
            self.defs[name] = {}
            self.defs[name] = self.node(d)
        return {"$ref": "#/$defs/" + name.replace("~", "~0").replace("/", "~1")}

    def _typed_anyOf(self, d: int) -> dict:
        return {"type": "string", "anyOf": [{"maxLength": 2}, {"format": "date"}, {"type": "integer"}]}

    def _nonfinite(self, d: int) -> dict:
        v = self.rng.choice(_NONFINITE)
        return self.rng.choice([{"const": v}, {"enum": [1, v]}, {"type": "integer", "minimum": v},
                                {"const": {"a": [v]}}, {"type": "integer", "exclusiveMaximum": v}])

    def _enum_const(self, d: int) -> dict:
        values = self.rng.sample(_VALUES, 3)
        return {"enum": values, "const": self.rng.choice(values + [1.0, -0.0, {"k": [None]}, "zz"])}

    def _ref_siblings(self, d: int) -> dict:
        r = self.rng
        sibling = r.choice([{"properties": {"name": self.node(d)}}, {"required": ["id"]}, {"minLength": 2},
                            {"additionalProperties": False}, {"additionalProperties": self.node(d)},
                            {"type": r.choice(["object", "string", "array", "integer"])}, {"maxItems": 2},
                            {"items": self.node(d)}, {"prefixItems": [self.node(d)]}, {"enum": r.sample(_VALUES, 3)},
                            {"minimum": 3, "maximum": 50}, {"anyOf": [self.node(d), {"type": "null"}]}])
        return {**self._ref(d), **sibling}

    def _closed_ref(self, d: int) -> dict:
        """issue 56's case: a $ref to a closed object, with properties beside it"""
        r = self.rng
        name = r.choice(["base", "closed", "b/ase"])
        if name not in self.defs:
            self.defs[name] = {}
            self.defs[name] = {"type": "object", "properties": {"id": self.node(d), "both": {"type": "integer"}},
                               "additionalProperties": r.choice([False, False, {"type": "integer"}, self.node(d)]),
                               "required": r.choice([[], ["id"]])}
        return {"$ref": "#/$defs/" + name.replace("/", "~1"), "properties": {"name": self.node(d), "both": self.node(d)},
                "required": r.choice([[], ["both"], ["name"]])}

    def _allOf_array(self, d: int) -> dict:
        r = self.rng
        a = r.choice([{"items": self.node(d)}, {"type": "array", "prefixItems": [self.node(d)],
                                                  "items": r.choice([False, True, self.node(d)])},
                      {"type": "array", "items": {"type": "integer"}}, {"minItems": 1, "maxItems": 4}])
        b = r.choice([{"prefixItems": [self.node(d), self.node(d)]}, {"items": self.node(d), "maxItems": 3},
                      {"type": "array", "prefixItems": [{"type": "string"}]}, {"items": False}])
        return {"allOf": [a, b]}

    def _allOf_object(self, d: int) -> dict:
        r = self.rng

        def side(names: list[str]) -> dict:
            s: dict[str, Any] = {"properties": {n: self.node(d) for n in names},
                                 "required": [n for n in names if r.random() < 0.3]}
            extra = r.choice(["absent", False, True, "schema"])
            if extra != "absent":
                s["additionalProperties"] = self.node(d) if extra == "schema" else extra
            return s
        return {"allOf": [{"type": "object", **side(["a", "b"])}, side(["b", "c"])]}

    def _allOf_bounds(self, d: int) -> dict:
        return self.rng.choice([
            {"allOf": [{"type": "string", "maxLength": 4}, {"minLength": 2, "maxLength": 6}]},
            {"allOf": [{"type": "integer", "minimum": -3}, {"maximum": 40, "minimum": 0}, {"exclusiveMaximum": 30}]},
            {"allOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 3}, {"minItems": 1, "maxItems": 5}]},
            {"allOf": [{"type": ["string", "integer"]}, {"type": ["integer", "null"]}, {"minimum": 3}]},
            {"allOf": [{"enum": [1, "a", 2.0, None]}, {"enum": [1.0, 2, "b"]}]},
            {"allOf": [{"type": "integer", "exclusiveMinimum": -2.5}, {"maximum": 9, "exclusiveMaximum": 7.5}]},
        ])

    def _oneOf_typeless(self, d: int) -> dict:
        return self.rng.choice([
            {"oneOf": [{"type": "string"}, {"minimum": 5}]},  # "abc" matches both: refused
            {"oneOf": [{"maxLength": 3}, {"minLength": 5}]},  # every non-string matches both: refused
            {"type": "string", "maxLength": 4, "oneOf": [{"maxLength": 10}, {"minLength": 1}]},  # refused
            {"oneOf": [{"type": "number"}, {"type": "integer"}]},  # refused
            {"type": "string", "oneOf": [{"maxLength": 2}, {"minLength": 3}]},
            {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}, {"type": "string"}]},
            {"oneOf": [{"type": "array", "maxItems": 1}, {"type": "array", "minItems": 2, "items": self.node(d)}]},
        ])

    def _oneOf_values(self, d: int) -> dict:
        return self.rng.choice([
            {"oneOf": [{"const": 1}, {"const": 1.0}]}, {"oneOf": [{"const": 0}, {"const": -0.0}]},  # refused
            {"oneOf": [{"const": {"a": 1, "b": [2]}}, {"const": {"b": [2], "a": 1}}]},  # refused
            {"oneOf": [{"enum": [1, "a"]}, {"enum": [True, 1.0]}]},  # refused
            {"oneOf": [{"enum": [1, "a"]}, {"enum": [2, "b", True]}]},
            {"oneOf": [{"const": "a"}, {"type": "string", "minLength": 2}]},
            {"oneOf": [{"enum": [1, 2]}, {"type": "integer", "minimum": 3}]},
            {"oneOf": [{"const": 0}, {"const": False}, {"const": None}, {"const": ""}]},
        ])

    def _oneOf_discriminated(self, d: int) -> dict:
        r = self.rng
        return {"oneOf": [{"type": "object", "properties": {"kind": {"const": k}, "v": self.node(d)},
                           "required": ["kind"] + (["v"] if r.random() < 0.5 else []),
                           "additionalProperties": r.choice([False, True])} for k in r.sample(["a", "b", "c"], 2)]}


_ATOMS = ["a", "b", "é", "😀", "\\.", '"', "\\\\", "\\n", "\\t", "\\d", "\\w", "\\s", "\\D", "\\W", "\\S", ".",
          "[a-c]", "[^a-c]", "[\\d_]", "[^\\w]", "[ -~]", "[\\x00-\\x1f]", "[é-ÿ]", "[-+]", "\\{", "\\$", "\\^"]


def random_pattern(rng: random.Random, depth: int = 1) -> str:
    """An anchored pattern of random atoms, classes, groups, alternations and repetitions."""
    return "^" + _sequence(rng, depth) + "$"


def _sequence(rng: random.Random, depth: int) -> str:
    out = []
    for _ in range(rng.randint(1, 3)):
        if depth > 0 and rng.random() < 0.3:
            alts = [_sequence(rng, depth - 1) for _ in range(rng.randint(1, 3))]
            atom = "(" + ("?:" if rng.random() < 0.3 else "") + "|".join(alts) + ")"
        else:
            atom = rng.choice(_ATOMS)
        if rng.random() < 0.5:
            lo = rng.randint(0, 3)
            atom += rng.choice(["?", "*", "+", f"{{{lo}}}", f"{{{lo},{lo + rng.randint(0, 3)}}}", f"{{{lo},}}", "*?"])
        out.append(atom)
    return "".join(out)


def nested_any_of(levels: int, width: int) -> dict[str, Any]:
    """`levels` of anyOf, `width` look-alike alternatives each, through $ref: issue 39's family
    (2 x 256 held the model 132 s past a 60 s request_timeout_s)."""
    defs: dict[str, Any] = {"l0": {"type": "string"}}
    for lv in range(1, levels + 1):
        defs[f"l{lv}"] = {"anyOf": [{"type": "object", "properties": {"v": {"$ref": f"#/$defs/l{lv - 1}"}},
                                     "required": ["v"]} for _ in range(width)]}
    return {"$ref": f"#/$defs/l{levels}", "$defs": defs}
