"""Objects and arrays of a JSON schema as GBNF (edge.serve.schema.convert's containers).

An object's members come in the order of `properties` (then the `required` names it does not
list, then extra keys): after a member, a comma and the next member, or the end once no
required one is left. Which member comes next is read from its key, through a trie of the
names still allowed (every optional one up to the next required one): one grammar stack while a
key is read, however many optional properties there are. Extra keys (`additionalProperties`
true or a schema) are strings of raw characters that leave the trie of the declared names
somewhere, so no extra key is ever a declared name.

An array is its `prefixItems` in order, then `items` for every other one (none with `items:
false`), between `minItems` and `maxItems` in all.
"""

from __future__ import annotations

import json
from typing import Any

from edge.serve.schema.enums import gbnf_literal
from edge.serve.schema.merge import Refused
from edge.serve.schema.repeat import MAX_REPEAT, repeat
from edge.serve.schema.stacks import Part, box, leaf, seq, times

__all__ = ["MAX_OPTIONAL_PROPERTIES", "array_part", "object_part"]

MAX_OPTIONAL_PROPERTIES = 128
# keys of one trie: past it, the next KEY_WINDOW keys are a trie of their own beside it (the
# tries would grow with the square of the optional properties; this way with their number
# times KEY_WINDOW, at one grammar stack more per window while a key is read)
KEY_WINDOW = 16
_RAW = '^"\\\\\\x00-\\x1F'  # a class body: what a JSON string may hold raw


def _raw(c: str) -> bool:
    return c not in '"\\' and c >= " "


def _class_char(c: str) -> str:
    return f"\\U{ord(c):08X}"


def _trie(allowed: dict[str, str], excluded: set[str], other: str | None) -> str:
    """GBNF after a key's opening quote: one of the `allowed` encoded names (each followed by its
    continuation), or, with `other`, a raw-character name that is none of `excluded`."""
    alts = []
    if "" in allowed:
        alts.append(f'"\\"" {allowed[""]}')
    elif other is not None and "" not in excluded:
        alts.append(f'"\\"" {other}')
    firsts = sorted({n[0] for n in allowed if n} | ({n[0] for n in excluded if n} if other is not None else set()))
    for c in firsts:
        sub_allowed = {n[1:]: v for n, v in allowed.items() if n[:1] == c}
        sub_other = other if _raw(c) else None
        if not sub_allowed and sub_other is None:
            continue
        run = c
        sub_excluded = {n[1:] for n in excluded if n[:1] == c}
        while sub_other is None and len(sub_allowed) == 1 and "" not in sub_allowed:
            (name, cont), = sub_allowed.items()  # one way on: the run of its characters
            run, sub_allowed = run + name, {"": cont}
        alts.append(f"{gbnf_literal(run)} {_trie(sub_allowed, sub_excluded, sub_other)}")
    if other is not None:
        avoid = "".join(_class_char(c) for c in sorted({n[0] for n in excluded if n} if excluded else set()) if _raw(c))
        alts.append(f'[{_RAW}{avoid}] j-kchar* "\\"" {other}')
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _members(conv: Any, s: dict[str, Any], where: str) -> tuple[list[tuple[str, Part, bool]], set[str]]:
    props = s.get("properties") or {}
    required = s.get("required") or []
    if not isinstance(props, dict):
        raise Refused(f"{where}.properties", "properties must be an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required) \
            or len(set(required)) != len(required):
        raise Refused(f"{where}.required", "required must be a list of distinct names")
    names = list(props) + [r for r in required if r not in props]
    if len([n for n in names if n not in required]) > MAX_OPTIONAL_PROPERTIES:
        raise Refused(f"{where}.properties", f"more than {MAX_OPTIONAL_PROPERTIES} optional properties "
                      "(the grammar's key tries grow with their square)")
    extra = s.get("additionalProperties", True)  # what a name not in `properties` must hold
    out = []
    for name in names:
        sub = props.get(name, extra)
        if sub is False:
            if name in required:
                key = f"properties.{name}" if name in props else "required"
                raise Refused(f"{where}.{key}", f"{name!r} is required, but its schema is `false`: no output "
                              "could match")
            continue
        out.append((name, conv.visit(sub, f"{where}.properties.{name}"), name in required))
    return out, set(names)


def object_part(conv: Any, s: dict[str, Any], where: str) -> Part:
    extra = s.get("additionalProperties")
    if "properties" not in s and "required" not in s and extra in (None, True):
        return conv.builtin("j-object")
    members, declared = _members(conv, s, where)
    excluded = {_key(n) for n in declared}
    costs = [p.cost for _, p, _ in members]
    other, end = None, "j-ws"  # after an extra key's quote; after the last declared member
    if extra not in (None, False):
        value = conv.visit(extra, f"{where}.additionalProperties")
        costs.append(value.cost)
        end = conv.rule("", leaf(1))  # extra members, each followed by the rest of them
        other = f'j-ws ":" j-ws {conv.rule(value.text, value.cost)} {end}'
        conv.rules[end] = f'j-ws ("," j-ws "\\"" {_trie({}, excluded, other)})?'
    n, keys = len(members), [_key(name) for name, _, _ in members]
    afters, chooses = [""] * n + [end], [""] * (n + 1)
    conts = [""] * n  # member k's key written: its value and what may follow it
    for i in range(n - 1, -1, -1):
        conts[i] = conv.rule(f'j-ws ":" j-ws {members[i][1].text} {afters[i + 1]}', members[i][1].cost)
        nxt = next((k for k in range(i, n) if members[k][2]), None)
        last = n - 1 if nxt is None else nxt  # the members that may come next: i..last
        window = range(i, min(last, i + KEY_WINDOW - 1) + 1)
        trie = _trie({keys[k]: conts[k] for k in window}, excluded,
                     other if nxt is None and window[-1] == n - 1 else None)
        if window[-1] < last:  # the keys past the window: the next window's trie, beside this one
            trie = f"({trie} | {chooses[window[-1] + 1]})"
        chooses[i] = conv.rule(trie, seq(costs))
        step = f'j-ws "," j-ws "\\"" {chooses[i]}'
        afters[i] = conv.rule(step if nxt is not None else f"({step})?", leaf(1))
    choose = chooses[0] if n else None
    required = any(r for _, _, r in members)
    first = f'"\\"" {choose}' if choose else (f'"\\"" {_trie({}, excluded, other)}' if other else "")
    body = first if required or not first else f"({first})?"
    return Part(f'"{{" j-ws {body} "}}"'.replace("  ", " "), box(seq(costs)), frozenset("{"))


def _key(name: str) -> str:
    """A property name as JSON writes it between the quotes."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def array_part(conv: Any, s: dict[str, Any], where: str) -> Part:
    items, prefix = s.get("items"), s.get("prefixItems", [])
    if isinstance(items, list):
        raise Refused(f"{where}.items", "items as a list is draft 4-2019's tuple: write prefixItems")
    lo, hi = s.get("minItems", 0), s.get("maxItems")
    for key, v in (("minItems", lo), ("maxItems", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPEAT):
            raise Refused(f"{where}.{key}", f"must be an integer from 0 to {MAX_REPEAT}")
    if not isinstance(prefix, list):
        raise Refused(f"{where}.prefixItems", "prefixItems must be a list of schemas")
    parts = []
    for i, p in enumerate(prefix):
        if p is False:  # no item i: at most i items
            hi = i if hi is None else min(hi, i)
            break
        parts.append(conv.visit(p, f"{where}.prefixItems[{i}]"))
    rest = None if items is False else conv.visit(True if items is None else items, f"{where}.items")
    if rest is None:
        hi = len(parts) if hi is None else min(hi, len(parts))
    if hi is not None and lo > hi:
        raise Refused(where, f"minItems {lo} is more than the {hi} items the schema allows")
    text, mult = _array_text(conv, parts[:hi] if hi is not None else parts, rest, lo, hi)
    costs = [p.cost for p in parts] + ([times(mult, rest.cost)] if rest is not None else [])
    return Part(text, box(seq(costs)), frozenset("["))


def _array_text(conv: Any, parts: list[Part], rest: Part | None, lo: int, hi: int | None) -> tuple[str, int]:
    """The array's GBNF (hi >= lo), and the stack multiplier of its repeated items."""
    if hi == 0 or not parts and rest is None:
        return '"[" j-ws "]"', 1
    k, mult = len(parts), 1
    base = max(k, 1)  # the items before the repeated ones
    after = "j-ws"
    if rest is not None and (hi is None or hi > base):
        sep = conv.rule(f'j-ws "," j-ws {conv.rule(rest.text, rest.cost)}', rest.cost)
        count, mult = repeat(conv, sep, max(lo - base, 0), None if hi is None else hi - base)
        after = f"{count} j-ws"
    for i in range(k - 1, 0, -1):  # after i items: item i and the rest, or (enough already) the end
        step = f'j-ws "," j-ws {parts[i].text} {after}'
        after = conv.rule(step if i < lo else f"({step} | j-ws)", parts[i].cost)
    first = parts[0].text if parts else rest.text  # type: ignore[union-attr]
    body = f"{first} {after}"
    return (f'"[" j-ws {body} "]"' if lo > 0 else f'"[" j-ws ({body} | ) "]"'), mult
