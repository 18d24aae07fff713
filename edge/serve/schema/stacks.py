"""How much work a grammar can make llama.cpp do per token, bounded before it is accepted.

llama.cpp's grammar keeps one stack per way the text so far can be read (identical stacks
merged), checks every candidate token against each, and de-duplicates the stacks after every
character: a token costs in proportion to the stacks, and accepting one character with their
square (1.5 ms at 1,024 stacks, 0.33 s at 16,384, measured in issue 39). Bytes do not bound them:
`anyOf` of 256 look-alike objects, each with an `anyOf` of 256 through `$ref`, is 40 KB of
grammar and 65,536 stacks; `^(a?){0,900}$` is 900.

Each rule of a converted schema carries a cost node; `stacks()` bounds the most stacks alive at
once, reading:
- `leaf(n)`: at most n (a string, a number, an enum's trie: 1; a pattern: its own estimate);
- `alt([(firsts, node), ...])`: all alternatives' starts at once, then, after the first
  character, only the alternatives that can start with it (summed);
- `seq([...])`: one member at a time (members here are separated by JSON's punctuation);
- `box(node)`: an object or array: one stack at its `{`/`[`, then the node's;
- `ref(name)`: the rule's; a cycle is iterated to a fixed point, and one that keeps growing
  (a recursive `anyOf` whose alternatives start alike) is unbounded.
and every stack may have a twin: one reading the optional space before the next token, one past
it (measured: 256 look-alike objects keep 512 stacks after `{`). The bound is an over-estimate:
a schema refused by it names the field and the limit (MAX_STACKS, docs/api.md "Grammar bounds").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = ["MAX_STACKS", "Cost", "Part", "alt", "box", "leaf", "ref", "seq", "stacks", "times"]

MAX_STACKS = 256  # grammar stacks at once: ~0.18 s a token over Gemma 3's vocabulary (docs/api.md)

# ("leaf", n) | ("alt", [(firsts, Cost)]) | ("seq", [Cost]) | ("ref", name) | ("times", k, Cost)
# | ("box", Cost)
Cost = Union[tuple]


@dataclass
class Part:
    """A schema's piece of grammar: its GBNF expression, cost node, and first characters."""

    text: str
    cost: Cost
    firsts: frozenset[str]  # what its first character can be ("0" for a number)


def leaf(n: int) -> Cost:
    return ("leaf", n)


def alt(parts: list[tuple[frozenset[str], Cost]]) -> Cost:
    return ("alt", parts)


def seq(parts: list[Cost]) -> Cost:
    return ("seq", parts)


def ref(name: str) -> Cost:
    return ("ref", name)


def box(part: Cost) -> Cost:
    """What starts with one fixed character (an object's `{`, an array's `[`): one stack at its
    start, whatever is inside."""
    return ("box", part)


def times(k: int, part: Cost) -> Cost:
    return ("times", k, part)


class _Eval:
    def __init__(self, rules: dict[str, Cost], cap: int) -> None:
        self.rules, self.cap = rules, cap
        self.known: dict[str, tuple[int, int]] = {}  # rule -> (stacks at its start, stacks at most)

    def value(self, c: Cost) -> tuple[int, int]:
        kind = c[0]
        if kind == "leaf":
            return c[1], c[1]
        if kind == "ref":
            return self.known.get(c[1], (1, 1))
        if kind == "box":
            return 1, self.value(c[1])[1]
        if kind == "times":
            start, most = self.value(c[2])
            return self._cap(start * c[1]), self._cap(most * c[1])
        if kind == "seq":
            vals = [self.value(p) for p in c[1]] or [(1, 1)]
            return vals[0][0], max(m for _, m in vals)
        vals = [(firsts, self.value(p)) for firsts, p in c[1]]
        start = self._cap(sum(s for _, (s, _) in vals))
        chars = set().union(*(f for f, _ in vals))
        after = max((sum(m for f, (_, m) in vals if ch in f) for ch in chars), default=1)
        return start, self._cap(max(start, after))

    def _cap(self, n: int) -> int:
        return min(n, self.cap + 1)

    def run(self) -> int:
        for _ in range(64):  # a fixed point of the cycles, or growth past the cap
            changed = False
            for name, cost in reversed(self.rules.items()):  # a rule's refs were made after it
                v = self.value(cost)
                if v != self.known.get(name, (1, 1)):
                    self.known[name], changed = v, True
            if not changed:
                break
        else:
            return self.cap + 1
        # a stack reading up to an optional space (` `?) has a twin past it: twice the positions
        return self._cap(2 * self.known.get("root", (1, 1))[1])


def stacks(rules: dict[str, Cost], cap: int = MAX_STACKS) -> int:
    """An upper bound of the grammar stacks alive at once (cap + 1: past the cap, or unbounded)."""
    return _Eval(rules, cap).run()
