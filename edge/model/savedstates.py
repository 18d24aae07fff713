"""The saved KV states of one model's prompt cache (edge.model.promptcache): states of earlier
sequences in host memory, least recently used first out, bounded by bytes; declared prefixes
pinned. What a state can serve: the longest common prefix (LCP) of its tokens with a prompt,
where the state can be cut back that far (a windowed state of a sliding-window model only from
its end, edge.model.checkpoints).

Every method runs on the model's scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["CacheStats", "Entry", "MIN_REUSE", "SavedStates", "lcp"]

MIN_REUSE = 16  # tokens: a shorter common prefix is a miss (a BOS, a chat turn's opener)


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a prefix reused whole) at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slices, not a Python loop
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Entry:
    """One saved sequence state."""

    tokens: list[int]
    state: bytearray  # as edge.model.native.Native.state_bytes made it (restored in place, not copied)
    name: str = ""  # a declared prefix's name; "" for a state saved from traffic
    pinned: bool = False
    checkpoint: bool = False  # kept when restored: saved where prompts part (see _checkpoint, checkpoints)
    hits: int = 0  # requests that reused it
    reused: int = 0  # the shortest prefix of it those requests reused (what is worth keeping)
    pos_min: int = 0  # the oldest position it holds (a sliding window keeps only its end)
    whole: bool = False  # Native.state_bytes(whole=True): restored with set_state(whole=True)
    # the window before its end's (edge.model.windowed): positions [pos_min, piece_end) of every layer
    piece: bytearray | None = None
    piece_end: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.state) + (len(self.piece) if self.piece is not None else 0)

    def hit(self, n: int, times: int = 1) -> None:
        self.hits += times
        self.reused = n if not self.reused else min(self.reused, n)


@dataclass
class CacheStats:
    """Counters read by /metrics (plain ints, written on the worker thread)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    restores: int = 0
    saves: int = 0
    evictions: int = 0


@dataclass
class SavedStates:
    """The saved states of one model, by bytes."""

    native: Native
    limit_bytes: int
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # oldest use first
    stats: CacheStats = field(default_factory=CacheStats)
    nbytes: int = 0  # state bytes held: kept as entries come and go (read by /metrics)
    _next: int = 0

    def _drop(self, key: int) -> Entry:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry

    def _serves(self, e: Entry, tokens: list[int], last: int | None = None) -> int:
        """How long a prefix of `tokens` (at most `last`) `e` can be continued from: it is cut
        back there, which a state saved with only a sliding window's end cannot be far (0)."""
        m = lcp(e.tokens, tokens) if last is None else min(lcp(e.tokens, tokens), last)
        return m if self._reaches(e, m) else 0

    def _reaches(self, e: Entry, m: int) -> bool:
        return m == len(e.tokens) or self.native.reaches(e.pos_min, m)

    def _served(self, tokens: list[int]) -> int:
        """The longest prefix of `tokens` a saved state gives."""
        return max((self._serves(e, tokens) for e in self.entries.values()), default=0)

    def _gives_all_of(self, new: Entry, e: Entry) -> bool:
        """Whether `new` gives every prefix an unpinned `e` is kept for: from the shortest one
        requests reused of it on, or, never reused, all it can be cut back to."""
        need = min(e.reused, len(e.tokens)) if e.hits else len(e.tokens)
        if e.pinned or lcp(new.tokens, e.tokens) < need or not self._reaches(new, need):
            return False
        return bool(e.hits) or not e.whole or new.pos_min <= e.pos_min

    def _fits(self, nbytes: int, protect: int | None = None) -> bool:
        """Whether `nbytes` more can be held beside the pinned states and `protect`."""
        return sum(e.nbytes for k, e in self.entries.items() if e.pinned or k == protect) + nbytes <= self.limit_bytes

    def _make_room(self, nbytes: int, protect: int | None = None) -> bool:
        """Evict the least recently used unpinned states (never `protect`) until `nbytes` more
        fit; False (nothing evicted) where they cannot fit at all."""
        if not self._fits(nbytes, protect):
            return False
        for key in [k for k, e in self.entries.items() if not e.pinned and k != protect]:
            if self.nbytes + nbytes <= self.limit_bytes:
                break
            self._drop(key)
            self.stats.evictions += 1
        return True

    def add(self, entry: Entry, protect: int | None = None) -> bool:
        """Keep `entry` (as the most recently used), evicting the least recently used unpinned
        states (never `protect`) until it fits; False (nothing changed) when it cannot fit."""
        if not self._make_room(entry.nbytes, protect):
            return False
        self._insert(entry)
        return True

    def _insert(self, entry: Entry) -> int:
        key, self._next = self._next, self._next + 1
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        self.stats.saves += 0 if entry.pinned else 1
        return key

    def clear(self) -> None:
        """Every saved state gone (the model is being closed)."""
        for key in list(self.entries):
            self._drop(key)

    def pinned(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.pinned]

    def most_reused(self, n: int) -> list[Entry]:
        """Up to n unpinned states that requests reused most (checkpoints, mostly): what is worth
        keeping across a restart, each to be cut to the prefix those requests reused."""
        pool = [e for e in self.entries.values() if not e.pinned and e.hits and not self._covered(e)]
        return sorted(pool, key=lambda e: (-e.hits, -e.reused))[:n]

    def _covered(self, e: Entry) -> bool:
        """Whether a pinned (declared) state already gives what `e` was reused for: a learned
        copy of a declared prefix would only take a learned slot and its bytes twice."""
        need = min(e.reused or len(e.tokens), len(e.tokens))
        return any(p.pinned and lcp(p.tokens, e.tokens) >= need and self._reaches(p, need)
                   for p in self.entries.values())
