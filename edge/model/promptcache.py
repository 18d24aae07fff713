"""The prompt cache: KV states of many prefixes in host memory, so that a prefix survives an
unrelated request.

A model has one live sequence in llama.cpp's KV cache (requests on a model are sequential). Beside
it, this cache keeps saved states (llama_state_seq_get_data) of earlier sequences, least recently
used first out, bounded by bytes. A request's prompt is matched against the live sequence and
every saved state by longest common prefix (LCP); the longest wins: a saved state is restored
into the live sequence (a memcpy) and cut to the common part, and only the rest of the prompt is
prefilled. Before the live sequence loses more than it keeps to a new prompt, its state is saved
(as llama-server's prompt cache does), so one unrelated request costs the next user of a long
prefix one restore instead of a full prefill.

Declared prefixes (config) are pinned: never evicted, restored at every start from their state
on disk (edge.model.prefixstore). Learned prefixes are the unpinned states that traffic reused most.

Every method runs on the model's worker thread, between generations: a restore never races one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["CacheStats", "Entry", "PromptCache", "lcp", "MIN_REUSE"]

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
    checkpoint: bool = False  # saved at the end of a prefix two requests shared (see _checkpoint)
    hits: int = 0  # requests that reused it
    reused: int = 0  # the shortest prefix of it those requests reused (what is worth keeping)
    pos_min: int = 0  # the oldest position it holds (a sliding window keeps only its end)

    @property
    def nbytes(self) -> int:
        return len(self.state)

    def hit(self, n: int) -> None:
        self.hits += 1
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
class PromptCache:
    """The live sequence of one model and the saved states beside it."""

    native: Native
    limit_bytes: int
    live: list[int] = field(default_factory=list)  # tokens whose KV is in the sequence now
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # oldest use first
    stats: CacheStats = field(default_factory=CacheStats)
    nbytes: int = 0  # state bytes held: kept as entries come and go (read by /metrics)
    _next: int = 0

    def _drop(self, key: int) -> Entry:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry

    # -- a request's prompt into the sequence ----------------------------------------------------
    def prefill(self, tokens: list[int], use_cache: bool = True, remember: bool = True) -> int:
        """Make the sequence hold `tokens` with the last one's logits computed; reuse the longest
        cached prefix (unless `use_cache` is False: then the whole prompt is computed from
        position 0). `remember` False (warm-up) leaves the saved states and counters alone.
        Returns how many prompt tokens were reused."""
        last = len(tokens) - 1  # at most: the last prompt token is decoded again, its logits are needed
        n, source = (min(lcp(self.live, tokens), last), None) if use_cache else (0, None)
        if n and not self.native.can_continue_at(n):
            n = 0  # the sliding-window layers no longer hold what position n needs
        if use_cache:
            key, best = self._best_entry(tokens, last)
            if best > n + MIN_REUSE // 2:
                n, source = best, key
        if remember:
            self._save_live_if_losing(n if source is None else 0, protect=source)
        if source is not None and not self._restore(source):
            n = 0
        if n < len(self.live) and not (self.native.keep(n) and self.native.can_continue_at(n)):
            n = 0  # memory that cannot drop a suffix (recurrent models): start over
        elif source is not None:
            self._taken(source)
        if n == 0:
            self.native.clear()
        self.live = list(tokens[:n])
        if remember:
            self._count(n)
            if n >= MIN_REUSE:
                self._checkpoint()
        try:
            self.native.decode(tokens[n:], n)
        except BaseException:
            self.reset()
            raise
        self.live = list(tokens)
        return n

    def append(self, tok: int) -> None:
        """A generated token was decoded into the sequence."""
        self.live.append(tok)

    def _count(self, n: int) -> None:
        """One generation's reuse: a hit from MIN_REUSE tokens on; every reused token counted
        (so the counter is the sum of what each generation's usage says it reused)."""
        self.stats.reused_tokens += n
        if n >= MIN_REUSE:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def _best_entry(self, tokens: list[int], last: int) -> tuple[int | None, int]:
        """The saved state that gives `tokens` the longest prefix it can really continue from
        (a state saved with only a sliding window's end cannot be cut far back)."""
        best: tuple[int | None, int] = (None, 0)
        for key, e in self.entries.items():
            m = min(lcp(e.tokens, tokens), last)
            if m > best[1] and (m == len(e.tokens) or self.native.reaches(e.pos_min, m)):
                best = (key, m)
        return best

    def _restore(self, key: int) -> bool:
        entry = self.entries[key]
        if not self.native.set_state(entry.state):
            self._drop(key)  # llama.cpp refused it: never offered again
            self.live = []
            return False
        self.stats.restores += 1
        self.live = list(entry.tokens)
        self.entries.move_to_end(key)
        return True

    def _taken(self, key: int) -> None:
        """A restored state that was used: its tokens live in the sequence now (and are saved
        again with it if needed), unless it is kept for good (pinned, a checkpoint)."""
        entry = self.entries.get(key)
        if entry is not None and not (entry.pinned or entry.checkpoint):
            self._drop(key)

    def _checkpoint(self) -> None:
        """The sequence holds exactly a prefix this request shares with an earlier one: keep its
        state, unless a saved state already ends within MIN_REUSE tokens before its end. Saved
        at the prefix's end, it serves the next request that starts with it after any number of
        unrelated ones; a state saved further on could not be cut back to it where
        sliding-window layers keep only their window (llama.cpp saves only the window). A longer
        checkpoint of the same prefix gives way: checkpoints converge on what requests share."""
        n, prefix = len(self.live), self.live
        for key, e in self.entries.items():
            m = lcp(e.tokens, prefix)
            if m == len(e.tokens) and m >= n - MIN_REUSE:
                e.hit(m)  # this request reused what it holds
                self.entries.move_to_end(key)
                return
        size = self.native.state_size()
        if not size or not self._room_for(size):
            return
        longer = [k for k, e in self.entries.items() if e.checkpoint and lcp(e.tokens, prefix) == n < len(e.tokens)]
        hits = sum(self._drop(k).hits for k in longer)  # their requests shared this shorter prefix too
        entry = Entry(list(prefix), self.native.state_bytes(), checkpoint=True, hits=hits,
                      pos_min=self.native.pos_min())
        entry.hit(n)
        self.add(entry)

    def _save_live_if_losing(self, keep: int, protect: int | None = None) -> None:
        """Save the live state before a prompt throws more of it away than it keeps, unless a
        saved state already covers most of it. `protect`: a state about to be restored, which
        making room must not evict."""
        lose = len(self.live) - keep
        if lose < MIN_REUSE or lose <= keep:
            return
        covered = max((lcp(e.tokens, self.live) for e in self.entries.values()), default=0)
        size = self.native.state_size() if covered * 2 < len(self.live) else 0
        if not size or not self._room_for(size, protect):
            return
        self.add(Entry(list(self.live), self.native.state_bytes(), pos_min=self.native.pos_min()), protect)

    def _room_for(self, nbytes: int, protect: int | None = None) -> bool:
        """Whether a state of `nbytes` can be kept at all (beside the pinned states and the one
        protected), before it is copied out of llama.cpp."""
        kept = sum(e.nbytes for k, e in self.entries.items() if e.pinned or k == protect)
        return kept + nbytes <= self.limit_bytes

    # -- saved states ----------------------------------------------------------------------------
    def add(self, entry: Entry, protect: int | None = None) -> bool:
        """Keep `entry` (as the most recently used), evicting the least recently used unpinned
        states (never `protect`) until it fits; False (nothing changed) when it cannot fit."""
        if not self._room_for(entry.nbytes, protect):
            return False
        used = self.nbytes
        for key in [k for k, e in self.entries.items() if not e.pinned and k != protect]:
            if used + entry.nbytes <= self.limit_bytes:
                break
            used -= self._drop(key).nbytes
            self.stats.evictions += 1
        self.entries[self._next] = entry
        self.nbytes += entry.nbytes
        self._next += 1
        self.stats.saves += 0 if entry.pinned else 1
        return True

    # -- states from and to disk (edge.model.prefixstore) ------------------------------------------------
    def load(self, tokens: list[int], state: bytearray) -> bool:
        """A saved state into the sequence, its tokens made live; False (and an empty sequence)
        where llama.cpp refuses it."""
        if self.native.set_state(state):
            self.live = list(tokens)
            return True
        self.live = []
        return False

    def compute(self, tokens: list[int]) -> bytearray:
        """`tokens` prefilled from position 0; the sequence's state after them."""
        self.reset()
        try:
            self.native.decode(tokens, 0)
        except BaseException:
            self.reset()
            raise
        self.live = list(tokens)
        return self.native.state_bytes()

    def cut(self, e: Entry, n: int) -> tuple[list[int], bytearray] | None:
        """`e`'s tokens and state cut to its first n tokens, where its window reaches back that
        far (else whole); None where llama.cpp refuses the state."""
        if not self.load(e.tokens, e.state):
            return None
        if n < len(e.tokens) and self.native.reaches(e.pos_min, n) and self.native.keep(n):
            self.live = self.live[:n]
            return list(self.live), self.native.state_bytes()
        return list(e.tokens), e.state

    def clear(self) -> None:
        """Every saved state gone (the model is being closed)."""
        for key in list(self.entries):
            self._drop(key)

    def reset(self) -> None:
        """After a failed decode the sequence's content is unknown: empty it."""
        self.native.clear()
        self.live = []

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
        return any(p.pinned and lcp(p.tokens, e.tokens) >= need
                   and (need == len(p.tokens) or self.native.reaches(p.pos_min, need))
                   for p in self.entries.values())
