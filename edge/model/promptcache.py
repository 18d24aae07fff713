"""The prompt cache: KV states of many prefixes in host memory, so that a prefix survives an
unrelated request.

A model has one live sequence per slot in llama.cpp's KV cache (edge.model.slots: `parallel`
requests decoded at once; the cache works on the slot `native.seq` names). Beside them, this
cache keeps saved states (llama_state_seq_get_data) of earlier sequences, least recently used
first out, bounded by bytes. A request's prompt is matched against its slot's live sequence,
the other slots' (their cells are shared: llama_memory_seq_cp) and every saved state by longest
common prefix (LCP); the longest wins: a saved state is restored into the slot's sequence (a
memcpy) and cut to the common part, and only the rest of the prompt is prefilled. Before the live sequence loses more than it keeps to a new prompt, its state is saved
(as llama-server's prompt cache does), so one unrelated request costs the next user of a long
prefix one restore instead of a full prefill.

Sliding-window models (`swa_full = false`) keep only each window, so their states are saved whole
(every position the window cache still holds: it can be cut back that far) and a prefill copies
the state at the positions later prompts are likely to continue from (edge.model.checkpoints).

Declared prefixes (config) are pinned: never evicted, restored at every start from their state
on disk (edge.model.prefixstore). Learned prefixes are the unpinned states that traffic reused most.

Every method runs on the model's scheduler thread (edge.serve.worker), between llama_decode calls:
a restore never races one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from edge.model.checkpoints import MIN_NEW, PrefillCheckpoints, positions

if TYPE_CHECKING:
    from edge.model.native import Native

Marks = Union[Sequence[int], Callable[[], Sequence[int]]]  # positions worth a checkpoint, or how to find them

__all__ = ["CacheStats", "Entry", "Marks", "PromptCache", "lcp", "MIN_REUSE"]

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

    @property
    def nbytes(self) -> int:
        return len(self.state)

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
class PromptCache:
    """The live sequence of one model and the saved states beside it."""

    native: Native
    limit_bytes: int
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # oldest use first
    stats: CacheStats = field(default_factory=CacheStats)
    nbytes: int = 0  # state bytes held: kept as entries come and go (read by /metrics)
    lives: dict[int, list[int]] = field(default_factory=dict)  # per slot: tokens whose KV its sequence holds
    turns: dict[int, bool] = field(default_factory=dict)  # per slot: its live sequence is a chat turn
    _next: int = 0

    @property
    def live(self) -> list[int]:
        """The tokens whose KV is in the current slot's sequence (native.seq)."""
        return self.lives.get(self.native.seq, [])

    @live.setter
    def live(self, tokens: list[int]) -> None:
        self.lives[self.native.seq] = tokens

    @property
    def live_turn(self) -> bool:  # the slot's live sequence is a chat turn (its next turn continues it)
        return self.turns.get(self.native.seq, False)

    @live_turn.setter
    def live_turn(self, turn: bool) -> None:
        self.turns[self.native.seq] = turn

    def _drop(self, key: int) -> Entry:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry

    # -- a request's prompt into the sequence ----------------------------------------------------
    def prefill(self, tokens: list[int], use_cache: bool = True, remember: bool = True, marks: Marks = ()) -> int:
        """Make the sequence hold `tokens` with the last one's logits computed; reuse the longest
        cached prefix (unless `use_cache` is False: then the whole prompt is computed from
        position 0). `remember` False (warm-up) leaves the saved states and counters alone.
        `marks`: positions in `tokens` where later prompts are likely to part from this one
        (a chat template's turns), or a function that finds them if a checkpoint needs them.
        Returns how many prompt tokens were reused."""
        n, plan = self.begin(tokens, use_cache, remember, marks)
        try:
            self.native.decode(tokens[n:], n, None if plan is None else plan.after)
        except BaseException:
            self.reset()
            raise
        self.prefilled(tokens, marks)
        return n

    def begin(self, tokens: list[int], use_cache: bool = True, remember: bool = True,
              marks: Marks = ()) -> tuple[int, PrefillCheckpoints | None]:
        """The first half of prefill(): the slot's sequence cut to the longest cached prefix of
        `tokens`; (its length, the checkpoints the prefill of the rest takes, whose `after`
        runs after each batch). The scheduler decodes the rest in chunks, then calls prefilled()."""
        n = self._reuse(tokens, use_cache, remember)
        return n, self._checkpoints(tokens, n, marks) if use_cache and remember else None

    def prefilled(self, tokens: list[int], marks: Marks = ()) -> None:
        """The slot's sequence holds all of `tokens` now."""
        self.live, self.live_turn = list(tokens), bool(marks)

    def _reuse(self, tokens: list[int], use_cache: bool, remember: bool) -> int:
        """The sequence cut to the longest prefix of `tokens` it can continue from (the live
        one or a restored state); how long that is."""
        last = len(tokens) - 1  # at most: the last prompt token is decoded again, its logits are needed
        n, source = (min(lcp(self.live, tokens), last), None) if use_cache else (0, None)
        if n and not self.native.can_continue_at(n):
            n = 0  # the sliding-window layers no longer hold what position n needs
        slot, shared = self._best_slot(tokens, last) if use_cache else (None, 0)
        if use_cache:
            key, best = self._best_entry(tokens, last)
            if best > max(n, shared) + MIN_REUSE // 2:
                n, source, slot = best, key, None
        if slot is not None and shared > n + MIN_REUSE // 2:
            n, source = shared, None
        else:
            slot = None
        if remember:
            self._save_live_if_losing(n if source is None and slot is None else 0, protect=source)
        if slot is not None:
            self.native.copy_from(slot, n)  # another slot's cells, shared
            self.live = list(tokens[:n])
        if source is not None and not self._restore(source):
            n = 0
        if n < len(self.live) and not (self.native.keep(n) and self.native.can_continue_at(n)):
            n = 0  # memory that cannot drop a suffix (recurrent models): start over
        elif source is not None and remember:
            self._taken(source, n)
        if n == 0:
            self.native.clear()
        self.live = list(tokens[:n])
        if remember:
            self._count(n)
            if n >= MIN_REUSE:
                self._checkpoint()
        return n

    def append(self, tok: int) -> None:
        """A generated token was decoded into the sequence."""
        self.live.append(tok)

    def _best_slot(self, tokens: list[int], last: int) -> tuple[int | None, int]:
        """Another slot whose sequence gives `tokens` the longest prefix (its cells can be shared
        where its window still reaches back there); (slot, length)."""
        me, native = self.native.seq, self.native
        best: tuple[int | None, int] = (None, 0)
        for seq, live in self.lives.items():
            if seq == me or not live:
                continue
            m = min(lcp(live, tokens), last)
            if m > best[1] and native.reaches(native.pos_min(seq), m):
                best = (seq, m)
        return best

    def _count(self, n: int) -> None:
        """One generation's reuse: a hit from MIN_REUSE tokens on; every reused token counted
        (so the counter is the sum of what each generation's usage says it reused)."""
        self.stats.reused_tokens += n
        if n >= MIN_REUSE:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

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

    def _best_entry(self, tokens: list[int], last: int) -> tuple[int | None, int]:
        """The saved state that gives `tokens` the longest prefix it can really continue from."""
        best: tuple[int | None, int] = (None, 0)
        for key, e in self.entries.items():
            m = self._serves(e, tokens, last)
            if m > best[1]:
                best = (key, m)
        return best

    def _restore(self, key: int) -> bool:
        entry = self.entries[key]
        if not self.native.set_state(entry.state, entry.whole):
            self._drop(key)  # llama.cpp refused it: never offered again
            self.live = []
            return False
        self.stats.restores += 1
        self.live = list(entry.tokens)
        self.entries.move_to_end(key)
        return True

    def _taken(self, key: int, n: int) -> None:
        """A restored state whose first n tokens were used: kept (as the checkpoint of that
        prefix, see _checkpoint) where it can be cut back to them, else dropped (its tokens live
        in the sequence now and are saved again with it if needed)."""
        entry = self.entries.get(key)
        if entry is not None and not (entry.pinned or entry.checkpoint):
            if n >= MIN_REUSE and self._reaches(entry, n):
                entry.checkpoint = True
            else:
                self._drop(key)

    def _checkpoint(self) -> None:
        """The sequence holds exactly a prefix this request shares with an earlier one: keep its
        state, unless a saved state already gives it (to within MIN_REUSE tokens). Saved at the
        prefix's end, it serves the next request that starts with it after any number of
        unrelated ones. A longer checkpoint that shares this prefix but cannot be cut back to
        it (a sliding window's end) gives way: checkpoints converge on what requests share."""
        n, prefix = len(self.live), self.live
        for key, e in self.entries.items():
            m = self._serves(e, prefix)
            if m and m >= n - MIN_REUSE:
                e.hit(m)  # this request reused what it holds
                self.entries.move_to_end(key)
                return
        longer = [k for k, e in self.entries.items() if e.checkpoint and lcp(e.tokens, prefix) == n < len(e.tokens)]
        key = self._keep_live(prefix, checkpoint=True)
        if key is not None:
            entry = self.entries[key]
            entry.hits += sum(self._drop(k).hits for k in longer if k in self.entries)  # they shared it too
            entry.hit(n)

    def _checkpoints(self, tokens: list[int], n: int, marks: Marks) -> PrefillCheckpoints | None:
        """The copies a prefill of tokens[n:] takes (edge.model.checkpoints): sliding-window
        models only, at least MIN_NEW tokens computed, at positions no saved state gives."""
        if not self.native.n_swa or len(tokens) - n < MIN_NEW or not self.limit_bytes:
            return None
        found = marks() if callable(marks) else marks
        wanted = [p for p in positions(n, len(tokens), found) if self._served(tokens[:p]) < p - MIN_REUSE]
        if not wanted:
            return None
        return PrefillCheckpoints(wanted, len(tokens), lambda end, evict: self._keep_live(
            tokens[:end], checkpoint=True, evict=evict) is not None)

    def _save_live_if_losing(self, keep: int, protect: int | None = None) -> None:
        """Save the live state before a prompt throws more of it away than it keeps, unless
        saved states already give all but a few of its tokens: fewer than MIN_NEW and than half
        (a novel question after a prefix that is kept), or than MIN_REUSE for a chat turn, which
        the conversation's next turn continues. `protect`: a state about to be restored, which
        making room must not evict."""
        lose = len(self.live) - keep
        if lose < MIN_REUSE or lose <= keep:
            return
        least = MIN_REUSE if self.live_turn else min(MIN_NEW, (len(self.live) + 1) // 2)
        if len(self.live) - self._served(self.live) < least:
            return
        self._keep_live(self.live, protect)

    def _keep_live(self, tokens: list[int], protect: int | None = None, checkpoint: bool = False,
                   evict: bool = True) -> int | None:
        """The live sequence's state (it holds `tokens`) kept as the most recent entry; its key,
        or None where it cannot fit. The states it gives all of go first, then room is made
        (unless `evict` is False: free room only), then it is copied: the bytes held never
        pass the limit. Sliding-window models' states are saved whole, so they can be cut back."""
        whole = self.native.n_swa > 0 and self.native.whole_states
        size = self.native.state_size(whole)
        pos_min = self.native.pos_min() if whole else self.native.window_min()
        new = Entry(list(tokens), bytearray(), checkpoint=checkpoint, pos_min=pos_min, whole=whole)
        if not size or not self._fits(size, protect) or (not evict and self.nbytes + size > self.limit_bytes):
            return None
        for key in [k for k, e in self.entries.items() if k != protect and self._gives_all_of(new, e)]:
            old = self._drop(key)
            if old.hits:  # what reused it is what the new state is reused for
                new.hit(old.reused, old.hits)
        self._make_room(size, protect)
        new.state = self.native.state_bytes(whole)
        return self._insert(new)

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

    # -- saved states ----------------------------------------------------------------------------
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

    def give_way(self) -> None:
        """The slot's idle sequence gives its cells up: its state saved first where worth it."""
        self._save_live_if_losing(0)
        self.reset()

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
        return any(p.pinned and lcp(p.tokens, e.tokens) >= need and self._reaches(p, need)
                   for p in self.entries.values())
