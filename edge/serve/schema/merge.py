"""A JSON schema's conjunctions made one schema before it becomes a grammar
(edge.serve.schema.convert): `allOf`, a `$ref` with keywords beside it, `enum` beside `const`,
`type` beside `enum`/`const`/`anyOf`/`oneOf`. The merged schema means the intersection: every
constraint of every member is kept, or the merge is refused (`Refused`, naming the keyword),
never loosened, so the grammar's language stays inside the schema's:

- objects: each property name of either member gets the conjunction of what each member asks of
  it (its own `properties` entry, else that member's `additionalProperties`, absent meaning any
  value), and other names the conjunction of both `additionalProperties`: a closed member stays
  closed over the merged names (a `$ref` to `additionalProperties: false` plus sibling
  `properties` lets no new key through); `required` is the union;
- arrays: `prefixItems` position by position (a member's `items` where its prefix ends), then
  `items` with `items`;
- bounds: the tighter of two (`minLength`, `maxItems`, `minimum`...); `type` and the values of
  `enum`/`const` intersected (values compared as JSON values: 1 == 1.0); `pattern`/`format` set
  twice must be equal;
- `anyOf`/`oneOf` beside other keywords: each alternative with them ((A or B) and C is (A and C)
  or (B and C); for oneOf too, since C holds in both). An alternative that provably matches
  nothing (`Empty`: no common type or value, minLength past maxLength...) is dropped; one whose
  merge is refused for another reason refuses the whole schema.

`$ref` is a JSON pointer into the request's own schema (`#`, `#/$defs/x`, `#/properties/a`, with
`~0`/`~1` and percent escapes), never a name looked up among rules.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from edge.serve.schema.ranges import NoInteger, integer_bounds
from edge.serve.schema.values import json_key, kind, kinds_of_types

__all__ = ["ANNOTATIONS", "Empty", "Refused", "flatten", "merge", "pointer", "rebase", "type_set"]

TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
MAX_MERGE_DEPTH = 16  # allOf inside $ref inside allOf...: past this, refused (a merge that loops)
MAX_ALTERNATIVES = 256  # what distributing anyOf/oneOf over a merge may make (GRAMMAR_LIMITS.widest)
ANNOTATIONS = ("title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf")
_LEAST = ("minLength", "minItems", "minimum", "exclusiveMinimum")  # merged: the larger
_MOST = ("maxLength", "maxItems", "maximum", "exclusiveMaximum")  # merged: the smaller
_OWN = ("type", "required", "enum", "const", "properties", "additionalProperties", "prefixItems", "items")


class Refused(ValueError):
    """A schema (part) edge will not turn into a grammar; `where` is the keyword's path."""

    def __init__(self, where: str, why: str) -> None:
        self.where, self.why = where, why
        super().__init__(f"{where}: {why}")


class Empty(Refused):
    """A schema (part) that provably matches nothing: an alternative holding it can be dropped."""


def type_set(s: dict[str, Any], where: str) -> set[str] | None:
    """The types a schema's `type` allows (None: no `type`); `integer` implied by `number`."""
    t = s.get("type")
    if t is None:
        return None
    names = t if isinstance(t, list) else [t]
    if not names or not all(isinstance(x, str) and x in TYPES for x in names):
        raise Refused(f"{where}.type", f"type must be one of {list(TYPES)} or a non-empty list of them")
    out = set(names)
    return out | {"integer"} if "number" in out else out


def pointer(root: Any, ref: Any, where: str) -> Any:
    """The subschema `ref` points to in `root`."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise Refused(f"{where}.$ref", f"{ref!r}: only references into this schema (`#`, `#/$defs/name`) "
                      "are followed")
    node = root
    frag = urllib.parse.unquote(ref[1:])
    if frag and not frag.startswith("/"):
        raise Refused(f"{where}.$ref", f"{ref!r} is not a JSON pointer (`#/...`); anchors are not followed")
    for part in frag.split("/")[1:] if frag else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise Refused(f"{where}.$ref", f"{ref!r} points to nothing in the schema")
    if not isinstance(node, (dict, bool)):
        raise Refused(f"{where}.$ref", f"{ref!r} points to something that is not a schema")
    return node


_SUB_MAPS = ("properties", "$defs", "definitions")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties")


def rebase(s: Any, prefix: str) -> Any:
    """`s` with every `$ref` into it (`#...`) made to point into it where it now sits, at the
    JSON pointer `prefix` of a bigger schema (a tool's parameters inside a forced call's)."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#"):
        out["$ref"] = "#" + prefix + out["$ref"][1:]
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rebase(sub, prefix) for name, sub in out[key].items()}
    for key in _SUB_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [rebase(sub, prefix) for sub in out[key]]
    for key in _SUB_ONE:
        if key in out:
            out[key] = rebase(out[key], prefix)
    return out


class _Merger:
    """One merge of two schemas, at `where`, `depth` merges deep."""

    def __init__(self, where: str, root: Any, depth: int) -> None:
        self.where, self.root, self.depth = where, root, depth

    def sub(self, a: Any, b: Any, at: str) -> Any:
        """The conjunction of two subschemas; `false` where it provably matches nothing."""
        try:
            return merge(a, b, at, self.root, self.depth + 1)
        except Empty:
            return False

    def keywords(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in [*a, *(k for k in b if k not in a)]:
            if key in _OWN or key in ANNOTATIONS:
                continue
            if key not in a or key not in b:
                out[key] = a.get(key, b.get(key))
            elif key in _LEAST or key in _MOST:
                out[key] = (max if key in _LEAST else min)(a[key], b[key])
            elif json_key(a[key]) == json_key(b[key]):
                out[key] = a[key]
            else:
                raise Refused(f"{self.where}.{key}", f"allOf sets {key} twice, differently; edge merges only "
                              f"equal values of {key} (write the one that holds)")
        types = self.types(a, b)
        if types is not None:
            out["type"] = types if len(types) > 1 else types[0]
        if "required" in a or "required" in b:
            out["required"] = list(dict.fromkeys([*a.get("required", []), *b.get("required", [])]))
        out.update(self.object(a, b))
        out.update(self.array(a, b))
        sets = [x[k] if k == "enum" else [x[k]] for x in (a, b) for k in ("enum", "const") if k in x]
        if sets:
            out["enum"] = _common(sets, f"{self.where}.enum", "no value is in every enum/const given")
        return out

    def types(self, a: dict[str, Any], b: dict[str, Any]) -> list[str] | None:
        ta, tb = type_set(a, self.where), type_set(b, self.where)
        t = ta if tb is None else tb if ta is None else ta & tb
        if t is None:
            return None
        if not t:
            raise Empty(f"{self.where}.type", f"no value is both {sorted(ta or ())} and {sorted(tb or ())}")
        if "integer" in t and "number" in t:
            t.discard("integer")
        return sorted(t)

    def object(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        xa, xb = a.get("additionalProperties", True), b.get("additionalProperties", True)
        if "properties" in a or "properties" in b:
            pa, pb = a.get("properties") or {}, b.get("properties") or {}
            out["properties"] = {name: self.sub(pa.get(name, xa), pb.get(name, xb), f"{self.where}.properties.{name}")
                                 for name in [*pa, *(n for n in pb if n not in pa)]}
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self.sub(xa, xb, f"{self.where}.additionalProperties")
        return out

    def array(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ia, ib = a.get("items", True), b.get("items", True)
        if "prefixItems" in a or "prefixItems" in b:
            pa, pb = a.get("prefixItems") or [], b.get("prefixItems") or []
            out["prefixItems"] = [self.sub(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib,
                                           f"{self.where}.prefixItems[{i}]") for i in range(max(len(pa), len(pb)))]
        if "items" in a or "items" in b:
            out["items"] = self.sub(ia, ib, f"{self.where}.items")
        return out


def _common(sets: list[list[Any]], where: str, why: str) -> list[Any]:
    """The values of the first list that every other list holds (equal as JSON values)."""
    others = [{json_key(v) for v in s} for s in sets[1:]]
    keep = [v for v in sets[0] if all(json_key(v) in o for o in others)]
    if not keep:
        raise Empty(where, why)
    return keep


def _settled(s: dict[str, Any], where: str) -> dict[str, Any]:
    """`enum`, `const` and `type` made one `enum` of the values they all allow (Empty: none)."""
    if "enum" not in s and "const" not in s:
        return s
    at = f"{where}.enum" if "enum" in s else f"{where}.const"
    sets = [s["enum"]] if "enum" in s else []
    if "const" in s:
        sets.append([s["const"]])
    values = _common(sets, f"{where}.const", "enum and const have no value in common: no output could match")
    if "type" in s:
        kinds = kinds_of_types(type_set(s, where))
        values = [v for v in values if kind(v) in kinds]
        if not values:
            raise Empty(at, f"no value of it is of type {s['type']}: no output could match")
    return {**{k: v for k, v in s.items() if k not in ("enum", "const", "type")}, "enum": values}


def _check_empty(s: dict[str, Any], where: str) -> None:
    """Empty where the bounds leave nothing of the one type a schema allows: lengths or counts
    crossed, a required name no object may hold, more items than the positions allow, an
    integer range with no integer in it."""
    t = s.get("type")
    for lo, hi, of in (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array")):
        if t == of and s.get(lo, 0) > s.get(hi, s.get(lo, 0)):
            raise Empty(where, f"{lo} {s[lo]} is more than {hi} {s[hi]}: no output could match")
    props, extra = s.get("properties") or {}, s.get("additionalProperties", True)
    for name in s.get("required", ()) if t == "object" else ():
        if props.get(name, extra) is False:
            key = f"properties.{name}" if name in props else "required"
            raise Empty(f"{where}.{key}", f"{name!r} is required, but its schema is `false`: no output could match")
    prefix = s.get("prefixItems") or []
    most = next((i for i, p in enumerate(prefix) if p is False), len(prefix) if s.get("items", True) is False else None)
    if t == "array" and most is not None and s.get("minItems", 0) > most:
        raise Empty(where, f"minItems {s['minItems']} is more than the {most} items the schema allows")
    if t == "integer":
        try:
            integer_bounds(s)
        except NoInteger as exc:
            raise Empty(where, str(exc)) from None
        except ValueError:
            pass  # a bound the converter refuses, naming it


def merge(a: Any, b: Any, where: str, root: Any, depth: int = 0) -> Any:
    """The conjunction of two schemas as one (refs resolved at the top), or Refused."""
    if depth > MAX_MERGE_DEPTH:
        raise Refused(where, f"allOf/$ref merges nest more than {MAX_MERGE_DEPTH} deep (a reference cycle?)")
    for x, y in ((a, b), (b, a)):
        if y is True or y == {}:  # nothing to add: x as it is (a lone $ref stays a reference)
            return x
    if json_key(a) == json_key(b):  # A and A is A (a recursive $ref merged with itself ends here)
        return a
    a, b = (_resolved(flatten(x, where, root, depth + 1), where, root, depth) for x in (a, b))
    if a is False or b is False:
        return False
    if a is True or a == {} or b is True or b == {}:
        return b if a is True or a == {} else a
    for key in _LISTS:  # (A or B) and C: (A and C) or (B and C)
        for x, y in ((a, b), (b, a)):
            if key in x:
                return {key: _each(x[key], {k: v for k, v in x.items() if k != key}, y, f"{where}.{key}",
                                   root, depth)}
    out = _settled(_Merger(where, root, depth).keywords(a, b), where)
    _check_empty(out, where)
    return out


def _leaves(s: Any) -> int:
    """The alternatives a merged schema holds, through anyOf/oneOf in anyOf/oneOf."""
    alts = s.get("anyOf") or s.get("oneOf") if isinstance(s, dict) else None
    return sum(_leaves(a) for a in alts) if alts else 1


def _each(alts: list[Any], rest: dict[str, Any], other: Any, where: str, root: Any, depth: int) -> list[Any]:
    """Each alternative with `rest` and `other`; one that provably matches nothing is dropped
    (the union means the same without it), all of them: Empty. Refused once the alternatives
    made pass MAX_ALTERNATIVES (allOf of anyOfs multiplies them: 3 x 60 were 216,000 merges)."""
    out, first, made = [], None, 0
    for i, alt in enumerate(alts):
        try:
            out.append(merge(merge(alt, rest, f"{where}[{i}]", root, depth + 1), other, f"{where}[{i}]", root,
                             depth + 1))
        except Empty as exc:
            first = first or exc
            continue
        made += _leaves(out[-1])
        if made > MAX_ALTERNATIVES:
            raise Refused(where, f"merged with the keywords around it (allOf, a $ref beside keywords), it makes "
                          f"more than {MAX_ALTERNATIVES} alternatives, the widest alternation a grammar may have "
                          "(docs/api.md: grammar bounds)")
    if first is not None and not out:
        raise first  # every alternative: the first one's reason
    return out


def _resolved(s: Any, where: str, root: Any, depth: int) -> Any:
    """A lone `$ref` replaced by what it points to (flattened), for merging."""
    if isinstance(s, dict) and set(s) == {"$ref"}:
        if depth > MAX_MERGE_DEPTH:
            raise Refused(where, f"allOf/$ref merges nest more than {MAX_MERGE_DEPTH} deep (a reference cycle?)")
        return _resolved(flatten(pointer(root, s["$ref"], where), where, root, depth + 1), where, root, depth + 1)
    return s


def flatten(s: Any, where: str, root: Any, depth: int = 0) -> Any:
    """`s` with its top level's allOf, a $ref beside other keywords, enum beside const and type
    beside enum/const merged in (a $ref alone is left for the grammar to name)."""
    if not isinstance(s, dict):
        return s
    if depth > MAX_MERGE_DEPTH:
        raise Refused(where, f"allOf/$ref merges nest more than {MAX_MERGE_DEPTH} deep (a reference cycle?)")
    s = {k: v for k, v in s.items() if k not in ANNOTATIONS}
    if "allOf" in s:
        members = s["allOf"]
        out: Any = {k: v for k, v in s.items() if k != "allOf"}
        for i, member in enumerate(members):
            out = merge(out, member, f"{where}.allOf[{i}]", root, depth + 1)
        return flatten(out, where, root, depth + 1)
    if "$ref" in s and len(s) > 1:
        rest = {k: v for k, v in s.items() if k != "$ref"}
        return flatten(merge(pointer(root, s["$ref"], where), rest, where, root, depth + 1), where, root, depth + 1)
    for key in _LISTS:  # anyOf beside other keywords: each alternative with them
        if key in s and len(s) > 1:
            return merge({key: s[key]}, {k: v for k, v in s.items() if k != key}, where, root, depth + 1)
    out = _settled(s, where)
    _check_empty(out, where)
    return out
