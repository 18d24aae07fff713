"""The prompt cache: KV states of many prefixes in host memory, so that a prefix survives an
unrelated request.

A model has one live sequence per slot in llama.cpp's KV cache (edge.model.slots: `parallel`
requests decoded at once; every method names the slot's sequence it works on). Beside them, this
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

A slot whose cells a LoRA adapter selection computed (edge.model.turns) is private: its cells
are no prefix for anyone (no other slot shares them, no state of them is saved) until it is
emptied (`isolate`, `reset`).

Declared prefixes (config) are pinned: never evicted, restored at every start from their state
on disk (edge.model.prefixstore). Learned prefixes are the unpinned states that traffic reused most.

Every method runs on the model's scheduler thread (edge.serve.worker), between llama_decode calls:
a restore never races one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

from edge.model.checkpoints import MIN_NEW, PrefillCheckpoints, positions
from edge.model.savedstates import MIN_REUSE, CacheStats, Entry, SavedStates, lcp
from edge.model.windowed import cut_piece, splice_piece

Marks = Union[Sequence[int], Callable[[], Sequence[int]]]  # positions worth a checkpoint, or how to find them

__all__ = ["CacheStats", "Entry", "Marks", "PromptCache", "lcp", "MIN_REUSE"]


@dataclass
class PromptCache(SavedStates):
    """The live sequence of each slot of one model and the saved states beside them."""

    lives: dict[int, list[int]] = field(default_factory=dict)  # per slot: tokens whose KV its sequence holds
    turns: dict[int, bool] = field(default_factory=dict)  # per slot: its live sequence is a chat turn
    # per slot: (slot, n): its first n positions are cells of that slot too (llama_memory_seq_cp)
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)
    private: set[int] = field(default_factory=set)  # slots holding an adapter selection's cells (isolate)

    def live(self, seq: int) -> list[int]:
        """The tokens whose KV is in sequence `seq`."""
        return self.lives.get(seq, [])

    def held(self, seq: int) -> int:
        """Cells sequence `seq` holds that no other slot's counts: its tokens less a prefix copied
        from a slot that still holds it (edge.model.admission counts cells with it)."""
        live = self.live(seq)
        src, n = self.shared.get(seq, (seq, 0))
        n = min(n, len(live))
        return len(live) - (n if n and src != seq and self.live(src)[:n] == live[:n] else 0)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` made to hold `src`'s first n positions: the same cells (seq_cp)."""
        self.native.copy(src, dst, n)
        self.lives[dst] = self.live(src)[:n]
        self.shared[dst] = (src, n)
        if src in self.private:  # the same selection's cells (edge.model.slots only copies within one)
            self.private.add(dst)

    # -- a request's prompt into the sequence ----------------------------------------------------
    def prefill(self, seq: int, tokens: list[int], use_cache: bool = True, remember: bool = True,
                marks: Marks = ()) -> int:
        """Make sequence `seq` hold `tokens` with the last one's logits computed; reuse the longest
        cached prefix (unless `use_cache` is False: then the whole prompt is computed from
        position 0). `remember` False (warm-up) leaves the saved states and counters alone.
        `marks`: positions in `tokens` where later prompts are likely to part from this one
        (a chat template's turns), or a function that finds them if a checkpoint needs them.
        Returns how many prompt tokens were reused."""
        n, plan = self.begin(seq, tokens, use_cache, remember, marks)
        try:
            self.native.decode(seq, tokens[n:], n, None if plan is None else plan.after)
        except BaseException:
            self.reset(seq)
            raise
        self.prefilled(seq, tokens, marks)
        return n

    def begin(self, seq: int, tokens: list[int], use_cache: bool = True, remember: bool = True,
              marks: Marks = (), count: bool = True) -> tuple[int, PrefillCheckpoints | None]:
        """The first half of prefill(): sequence `seq` cut to the longest cached prefix of
        `tokens`; (its length, the checkpoints the prefill of the rest takes, whose `after`
        runs after each batch). The scheduler decodes the rest in chunks, then calls prefilled().
        `count` False: no generation's reuse (a suspended sequence resumed) for the counters."""
        n, parts = self._reuse(seq, tokens, use_cache, remember, count)
        return n, self._checkpoints(seq, tokens, n, marks, parts) if use_cache and remember else None

    def prefilled(self, seq: int, tokens: list[int], marks: Marks = ()) -> None:
        """Sequence `seq` holds all of `tokens` now."""
        self.lives[seq], self.turns[seq] = list(tokens), bool(marks)

    def _reuse(self, seq: int, tokens: list[int], use_cache: bool, remember: bool,
               count: bool = True) -> tuple[int, int]:
        """Sequence `seq` cut to the longest prefix of `tokens` it can continue from (its live
        one, another slot's or a restored state); (how long that is, where `tokens` part from a
        saved state too far from that state's end to be cut back to: 0 if none)."""
        last = len(tokens) - 1  # at most: the last prompt token is decoded again, its logits are needed
        native, live = self.native, self.live(seq)
        n, source = (min(lcp(live, tokens), last), None) if use_cache else (0, None)
        if n and not native.can_continue_at(seq, n):
            n = 0  # the sliding-window layers no longer hold what position n needs
        slot, shared = self._best_slot(seq, tokens, last) if use_cache else (None, 0)
        parts = 0
        if use_cache:
            key, best, parts = self._best_entry(tokens, last)
            if best > max(n, shared) + MIN_REUSE // 2:
                n, source, slot = best, key, None
        if slot is not None and shared > n + MIN_REUSE // 2:
            n, source = shared, None
        else:
            slot = None
        if remember:
            self._save_live_if_losing(seq, n if source is None and slot is None else 0, protect=source)
        if slot is not None:
            self.copy(slot, seq, n)  # another slot's cells, shared
        else:
            self.shared.pop(seq, None)  # its own cells, or a restored state's
        if source is not None and not self.load(seq, source, n):
            n = 0
        if n < len(self.live(seq)) and not (native.keep(seq, n) and native.can_continue_at(seq, n)):
            n = 0  # memory that cannot drop a suffix (recurrent models): start over
        elif source is not None and remember:
            self._taken(source, n)
        if n == 0:
            native.clear(seq)
        self.lives[seq] = list(tokens[:n])
        if remember:
            if count:
                self._count(n)
            if n >= MIN_REUSE:
                self._checkpoint(seq)
        return n, parts if parts > n + MIN_REUSE else 0

    def append(self, seq: int, tok: int) -> None:
        """A generated token was decoded into sequence `seq`."""
        self.lives.setdefault(seq, []).append(tok)

    def _best_slot(self, me: int, tokens: list[int], last: int) -> tuple[int | None, int]:
        """Another slot than `me` whose sequence gives `tokens` the longest prefix (its cells can
        be shared where its window still reaches back there); (slot, length)."""
        native = self.native
        best: tuple[int | None, int] = (None, 0)
        for seq, live in self.lives.items():
            if seq == me or not live or seq in self.private:
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

    def _best_entry(self, tokens: list[int], last: int) -> tuple[int | None, int, int]:
        """The saved state that gives `tokens` the longest prefix it can really continue from:
        (its key, that length, the longest prefix any saved state shares, cut back there or not)."""
        best: tuple[int | None, int] = (None, 0)
        shared = 0
        for key, e in self.entries.items():
            m = min(lcp(e.tokens, tokens), last)
            shared = max(shared, m)
            if m > best[1] and self._reaches(e, m):
                best = (key, m)
        return (*best, shared)

    def load(self, seq: int, key: int, n: int) -> bool:
        """Saved state `key` into sequence `seq`, to be cut back to n tokens: its window piece
        spliced in where the end's state alone does not reach back there (edge.model.windowed).
        False (an empty sequence; the state dropped, never offered again) where llama.cpp
        refuses it."""
        entry, native = self.entries[key], self.native
        ok = native.set_state(seq, entry.state, entry.whole)
        if ok and entry.piece is not None and n < len(entry.tokens) - 1:
            ok = splice_piece(native, seq, entry.piece, entry.pos_min, entry.piece_end)
        if not ok:
            native.clear(seq)
            self._drop(key)
            self.lives[seq] = []
            return False
        self.stats.restores += 1
        self.lives[seq] = list(entry.tokens)
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

    def _checkpoint(self, seq: int) -> None:
        """The sequence holds exactly a prefix this request shares with an earlier one: keep its
        state, unless a saved state already gives it (to within MIN_REUSE tokens). Saved at the
        prefix's end, it serves the next request that starts with it after any number of
        unrelated ones. A longer checkpoint that shares this prefix but cannot be cut back to
        it (a sliding window's end) gives way: checkpoints converge on what requests share."""
        prefix = self.live(seq)
        n = len(prefix)
        for key, e in self.entries.items():
            m = self._serves(e, prefix)
            if m and m >= n - MIN_REUSE:
                e.hit(m)  # this request reused what it holds
                self.entries.move_to_end(key)
                return
        longer = [k for k, e in self.entries.items() if e.checkpoint and lcp(e.tokens, prefix) == n < len(e.tokens)]
        key = self._keep_live(seq, prefix, checkpoint=True)
        if key is not None:
            entry = self.entries[key]
            entry.hits += sum(self._drop(k).hits for k in longer if k in self.entries)  # they shared it too
            entry.hit(n)

    def _checkpoints(self, seq: int, tokens: list[int], n: int, marks: Marks,
                     parts: int = 0) -> PrefillCheckpoints | None:
        """The copies a prefill of tokens[n:] takes (edge.model.checkpoints): sliding-window
        models only, at least MIN_NEW tokens computed, at positions no saved state gives; `parts`:
        where the prompt parts from a saved state that could not be cut back there, a position
        the next prompt of the two is likely to continue from as well."""
        if not self.native.n_swa or len(tokens) - n < MIN_NEW or not self.limit_bytes:
            return None
        found = [*(marks() if callable(marks) else marks), *([parts] if parts else [])]
        wanted = [p for p in positions(n, len(tokens), found) if self._served(tokens[:p]) < p - MIN_REUSE]
        if not wanted:
            return None
        return PrefillCheckpoints(wanted, len(tokens), lambda end, evict: self._keep_live(
            seq, tokens[:end], checkpoint=True, evict=evict, cut_back=evict) is not None)

    def _save_live_if_losing(self, seq: int, keep: int, protect: int | None = None) -> None:
        """Save the live state before a prompt throws more of it away than it keeps, unless
        saved states already give all but a few of its tokens: fewer than MIN_NEW and than half
        (a novel question after a prefix that is kept), or than MIN_REUSE for a chat turn, which
        the conversation's next turn continues. `protect`: a state about to be restored, which
        making room must not evict."""
        live = self.live(seq)
        lose = len(live) - keep
        if lose < MIN_REUSE or lose <= keep or seq in self.private:
            return
        least = MIN_REUSE if self.turns.get(seq, False) else min(MIN_NEW, (len(live) + 1) // 2)
        if len(live) - self._served(live) < least:
            return
        self._keep_live(seq, live, protect, cut_back=True)

    def _keep_live(self, seq: int, tokens: list[int], protect: int | None = None, checkpoint: bool = False,
                   evict: bool = True, cut_back: bool = False) -> int | None:
        """Sequence `seq`'s state (it holds `tokens`) kept as the most recent entry; its key,
        or None where it cannot fit. The states it gives all of go first, then room is made
        (unless `evict` is False: free room only), then it is copied: the bytes held never
        pass the limit. A sliding-window model's state is saved whole where the context has
        one slot, else windowed, with (`cut_back`) the window before its end's as a piece
        (edge.model.windowed): either can be cut back."""
        native = self.native
        whole = native.n_swa > 0 and native.whole_states
        size = native.state_size(seq, whole)
        piece = cut_piece(native, seq, len(tokens)) if cut_back and not whole and size else None
        if piece is not None and not self._fits(size + len(piece[0]), protect):
            piece = None  # the end's state alone where both do not fit
        pos_min = native.pos_min(seq) if whole else piece[1] if piece else native.window_min(seq)
        new = Entry(list(tokens), bytearray(), checkpoint=checkpoint, pos_min=pos_min, whole=whole,
                    piece=piece[0] if piece else None, piece_end=len(tokens) - native.n_swa if piece else 0)
        size += len(piece[0]) if piece else 0
        if not size or not self._fits(size, protect) or (not evict and self.nbytes + size > self.limit_bytes):
            return None
        for key in [k for k, e in self.entries.items() if k != protect and self._gives_all_of(new, e)]:
            old = self._drop(key)
            if old.hits:  # what reused it is what the new state is reused for
                new.hit(old.reused, old.hits)
        self._make_room(size, protect)
        new.state = native.state_bytes(seq, whole)
        return self._insert(new)

    # -- saved states ----------------------------------------------------------------------------
    def give_way(self, seq: int) -> None:
        """Idle sequence `seq` gives its cells up: its state saved first where worth it."""
        self._save_live_if_losing(seq, 0)
        self.reset(seq)

    def suspend(self, seq: int) -> None:
        """Running sequence `seq` gives its cells up (edge.model.admission): its state saved,
        room made for it, unless a saved state gives all of it already; then emptied."""
        live = self.live(seq)
        if seq not in self.private and len(live) >= MIN_REUSE and self._served(live) < len(live) - 1:
            self._keep_live(seq, live)
        self.reset(seq)

    def isolate(self, seq: int) -> None:
        """Sequence `seq` emptied for an adapter selection's prompt (its state saved first where
        worth it), and private until it is emptied again."""
        self.give_way(seq)
        self.private.add(seq)

    def reset(self, seq: int) -> None:
        """Sequence `seq` emptied (after a failed decode its content is unknown)."""
        self.native.clear(seq)
        self.lives[seq], self.turns[seq] = [], False
        self.shared.pop(seq, None)
        self.private.discard(seq)
