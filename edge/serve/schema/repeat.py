"""`x{lo,hi}` for counts past what llama.cpp's grammar parser takes in one repetition.

llama.cpp refuses a repetition whose rule count reaches 2,000 (MAX_REPETITION_THRESHOLD), yet the
docs/api.md promises `maxLength`/`maxItems` up to 10,000. A longer one is written in blocks: `lo`
as q copies of `x{BLOCK}` and the rest, the optional part `n = hi - lo` as `(x{BLOCK}){0,q}
x{0,r}` with `r = n - q*BLOCK` between BLOCK-1 and 2*BLOCK-2: every count from 0 to n, none
beyond. A count inside the optional part can be read as j or j-1 blocks and a tail, so such a
repetition may keep up to 3 grammar stacks where one would do (the multiplier returned).
"""

from __future__ import annotations

from typing import Any

from edge.serve.schema.stacks import leaf

__all__ = ["BLOCK", "MAX_REPEAT", "repeat"]

BLOCK = 900  # copies per block, and the most one repetition asks llama.cpp for (< 2,000)
MAX_REPEAT = 10_000  # the most copies one schema count (minLength, maxItems...) or pattern part asks for


def _count(x: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return ""
    if hi is None:
        return {0: f"{x}*", 1: f"{x}+"}.get(lo, f"{x}{{{lo},}}")
    if (lo, hi) == (0, 1):
        return f"{x}?"
    return f"{x}{{{lo}}}" if lo == hi else f"{x}{{{lo},{hi}}}"


def repeat(conv: Any, x: str, lo: int, hi: int | None) -> tuple[str, int]:
    """GBNF for lo..hi (None: unbounded) copies of the rule `x`; and the stack multiplier. `conv`
    makes rules (`conv.rule(text, cost)`)."""
    if max(lo, hi or 0) <= BLOCK:
        return _count(x, lo, hi) or '""', 1
    block = conv.rule(f"{x}{{{BLOCK}}}", leaf(1))
    q, b = divmod(lo, BLOCK)
    parts = [_count(block, q, q)] if q else []
    if b:
        parts.append(_count(x, b, b))
    if hi is None:
        parts.append(f"{x}*")
        return " ".join(parts), 1
    n = hi - lo
    parts = [p for p in parts if p]
    if n <= BLOCK:
        parts.append(_count(x, 0, n))
        return " ".join(p for p in parts if p), 1
    q2 = (n - (BLOCK - 1)) // BLOCK
    parts += [_count(block, 0, q2), _count(x, 0, n - q2 * BLOCK)]
    return " ".join(parts), 3
