"""A JSON schema's conjunctions made one schema before it becomes a grammar
(edge.serve.schema.convert): `allOf`, a `$ref` with keywords beside it, `type` beside
`enum`/`const`/`anyOf`/`oneOf`. What cannot be merged exactly is refused (`Refused`, naming the
keyword), never loosened: the grammar's language must stay inside the schema's.

`$ref` is a JSON pointer into the request's own schema (`#`, `#/$defs/x`, `#/properties/a`, with
`~0`/`~1` and percent escapes), never a name looked up among rules.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

__all__ = ["Refused", "canonical", "json_types", "merge", "pointer", "rebase", "type_set"]

TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
MAX_MERGE_DEPTH = 16  # allOf inside $ref inside allOf...: past this, refused (a merge that loops)
_LISTS = ("anyOf", "oneOf")


class Refused(ValueError):
    """A schema (part) edge will not turn into a grammar; `where` is the keyword's path."""

    def __init__(self, where: str, why: str) -> None:
        self.where, self.why = where, why
        super().__init__(f"{where}: {why}")


def canonical(value: Any) -> str:
    """One text per JSON value (key order and 1 vs 1.0 aside as JSON Schema compares them)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def json_types(value: Any) -> set[str]:
    """The JSON Schema types a JSON value has (2 is an integer and a number, 2.0 as well)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


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


def _both(a: dict[str, Any], b: dict[str, Any], key: str, where: str) -> Any:
    """A keyword set on both sides: kept where they agree, else refused (no intersection here)."""
    if canonical(a[key]) != canonical(b[key]):
        raise Refused(f"{where}.{key}", f"allOf sets {key} twice, differently; edge merges only equal "
                      "values of it (write the one that holds)")
    return a[key]


def _merge_types(a: dict[str, Any], b: dict[str, Any], where: str) -> list[str] | None:
    ta, tb = type_set(a, where), type_set(b, where)
    if ta is None or tb is None:
        t = ta if tb is None else tb
    else:
        t = ta & tb
        if not t:
            raise Refused(f"{where}.type", f"no value is both {sorted(ta)} and {sorted(tb)}")
    if t is None:
        return None
    if "integer" in t and "number" in t:
        t.discard("integer")
    return sorted(t)


def _merge_properties(a: dict[str, Any], b: dict[str, Any], where: str, depth: int,
                      root: Any) -> dict[str, Any]:
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    out = dict(pa)
    for name, sub in pb.items():
        out[name] = merge(pa[name], sub, f"{where}.properties.{name}", root, depth + 1) if name in pa else sub
    return out


def merge(a: Any, b: Any, where: str, root: Any, depth: int = 0) -> Any:
    """The conjunction of two schemas as one (refs resolved at the top), or Refused."""
    if depth > MAX_MERGE_DEPTH:
        raise Refused(where, f"allOf/$ref merges nest more than {MAX_MERGE_DEPTH} deep (a reference cycle?)")
    a, b = (_resolved(flatten(x, where, root, depth + 1), where, root, depth) for x in (a, b))
    if a is False or b is False:
        return False
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    for key in _LISTS:  # (A or B) and C: (A and C) or (B and C)
        for x, y in ((a, b), (b, a)):
            if key in x:
                return {key: _each(x[key], {k: v for k, v in x.items() if k != key}, y, f"{where}.{key}",
                                   root, depth)}
    out: dict[str, Any] = {}
    for key in set(a) | set(b):
        if key == "type":
            t = _merge_types(a, b, where)
            if t is not None:
                out["type"] = t if len(t) > 1 else t[0]
        elif key == "properties":
            out[key] = _merge_properties(a, b, where, depth, root)
        elif key == "required":
            out[key] = list(dict.fromkeys([*(a.get(key) or []), *(b.get(key) or [])]))
        elif key in ("enum", "const") or key not in a or key not in b:
            continue
        else:
            out[key] = _both(a, b, key, where)
    for x, y in ((a, b), (b, a)):
        out.update({k: v for k, v in x.items() if k not in y and k not in ("enum", "const")})
    values = _values(a, b, where)
    if values is not None:
        out["enum"] = values
    return out


def _each(alts: list[Any], rest: dict[str, Any], other: Any, where: str, root: Any, depth: int) -> list[Any]:
    """Each alternative with `rest` and `other`; one that nothing can match is dropped (the
    union still holds), all of them: refused."""
    out, first = [], None
    for i, alt in enumerate(alts):
        try:
            out.append(merge(merge(alt, rest, f"{where}[{i}]", root, depth + 1), other, f"{where}[{i}]", root,
                             depth + 1))
        except Refused as exc:
            first = first or exc
    if not out:
        raise first  # type: ignore[misc]
    return out


def _values(a: dict[str, Any], b: dict[str, Any], where: str) -> list[Any] | None:
    """The values both sides' enum/const allow (None: neither limits the values)."""
    sets = [x[k] if k == "enum" else [x[k]] for x in (a, b) for k in ("enum", "const") if k in x]
    if not sets:
        return None
    keep = [v for v in sets[0] if all(canonical(v) in {canonical(w) for w in other} for other in sets[1:])]
    if not keep:
        raise Refused(f"{where}.enum", "no value is in every enum/const given")
    return keep


def _resolved(s: Any, where: str, root: Any, depth: int) -> Any:
    """A lone `$ref` replaced by what it points to (flattened), for merging."""
    if isinstance(s, dict) and set(s) == {"$ref"}:
        return flatten(pointer(root, s["$ref"], where), where, root, depth + 1)
    return s


def flatten(s: Any, where: str, root: Any, depth: int = 0) -> Any:
    """`s` with its top level's allOf, a $ref beside other keywords, and type beside enum/const
    merged in (a $ref alone is left for the grammar to name)."""
    if not isinstance(s, dict):
        return s
    if "allOf" in s:
        members = s["allOf"]
        out: Any = {k: v for k, v in s.items() if k != "allOf"}
        for i, member in enumerate(members):
            out = merge(out, member, f"{where}.allOf[{i}]", root, depth + 1)
        return flatten(out, where, root, depth + 1)
    if "$ref" in s and len(s) > 1:
        rest = {k: v for k, v in s.items() if k != "$ref"}
        target = pointer(root, s["$ref"], where)
        return merge(target, rest, where, root, depth + 1)
    for key in _LISTS:  # anyOf beside other keywords: each alternative with them
        if key in s and len(s) > 1:
            return merge({key: s[key]}, {k: v for k, v in s.items() if k != key}, where, root, depth + 1)
    if ("enum" in s or "const" in s) and "type" in s:
        types = type_set(s, where) or set()
        values = s["enum"] if "enum" in s else [s["const"]]
        keep = [v for v in values if json_types(v) & types]
        if not keep:
            raise Refused(f"{where}.enum" if "enum" in s else f"{where}.const",
                          f"no value of it is of type {s['type']}: no output could match")
        return {**{k: v for k, v in s.items() if k not in ("type", "const")}, "enum": keep}
    return s
