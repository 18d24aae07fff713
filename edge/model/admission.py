"""Who gets the cells of one llama.cpp context (edge.model.slots): admission, idle slots giving
way, and suspension when the running sequences outgrow the context.

The slots share n_ctx cells (unified KV). A sequence takes cells as its tokens are decoded; none
are reserved for the answer it may still write (max_tokens), so the context holds as many
requests as their prompts and answers so far allow, not as many as their worst cases would:
- **admission**: a request starts when a slot is free and its prompt fits beside what the running
  sequences hold and will hold once their prompts are in, with GROWTH cells of room for each of
  them; requests start in the order they came, suspended ones first (no request overtakes one
  that waited longer).
- **idle slots give way**: a finished sequence's cells stay as its slot's cached prefix (the
  prompt cache's live sequence) until a step needs them; then the least recently used give them
  up, their state saved to the prompt cache first where worth it (edge.model.promptcache).
- **suspension**: when a step finds no cells (llama_decode returns 1: nothing was decoded) and no
  idle slot has any to give, the youngest running sequence (the last admitted) gives its cells
  up: its state is saved to the prompt cache, and it waits at the head of the queue with its
  prompt and answer so far; when room comes back it is restored into any free slot (or computed
  again from the prompt cache's longest prefix) and samples on. Never an error: one request
  alone always fits (its prompt and max_tokens are checked against n_ctx before it is queued).

Cells are counted from what each slot's sequence holds (PromptCache.lives), which counts shared
cells (choices of one prompt, seq_cp) once per slot: never fewer than llama.cpp uses, so the
count errs towards giving way early; llama.cpp's own answer (return code 1) is what suspends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from edge.model.savedstates import MIN_REUSE, lcp
from edge.model.sequence import Sequence, Slot, SlotState, SlotStats
from edge.model.turns import selection_of

if TYPE_CHECKING:
    from edge.model.generate import Job
    from edge.model.native import Native
    from edge.model.promptcache import PromptCache

__all__ = ["Admission", "GROWTH"]

GROWTH = 32  # cells of room per running sequence for a request to start beside them


class Slots(Protocol):
    """What admission works on (edge.model.slots.Slots)."""

    native: Native
    cache: PromptCache
    slots: list[Slot]
    active: list[Sequence]  # holding a slot, in admission order
    stats: SlotStats

    def resume(self, seq: Sequence) -> None: ...

    def release(self, seq: Sequence) -> None: ...


class Admission:
    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.suspended: list[Sequence] = []  # in admission order: the oldest resumes first

    # -- what the cells hold -----------------------------------------------------------------------
    def held(self, slot: Slot) -> int:
        return self.slots.cache.held(slot.id)

    def committed(self) -> int:
        """Cells the running sequences hold, or will hold once their prompts are in (a follower
        takes its leader's cells: none of its own until then)."""
        return sum(len(s.tokens) if s.state is SlotState.PREFILLING else 0 if s.leader is not None
                   else self.held(s.slot) for s in self.slots.active if s.slot is not None)

    def _room(self, tokens: int) -> bool:
        active = self.slots.active
        return not active or self.committed() + tokens + GROWTH * (len(active) + 1) <= self.slots.native.n_ctx

    def _free_slot(self) -> bool:
        return any(s.state.free for s in self.slots.slots)

    # -- admission ---------------------------------------------------------------------------------
    def fits(self, job: Job) -> bool:
        """Whether `job` can start now: no suspended sequence waits, a slot is free, and its prompt
        fits beside the running sequences (a prompt another slot is prefilling costs nothing:
        its cells are shared)."""
        if self.suspended or not self._free_slot():
            return False
        shared = job.cache_prompt and any(s.prefilling and s.job.cache_prompt and s.tokens == job.tokens
                                          and s.selection == selection_of(job) for s in self.slots.active)
        return self._room(0 if shared else len(job.tokens))

    def resume_suspended(self) -> None:
        """Suspended sequences back into free slots, oldest first, while they fit."""
        while self.suspended and self._free_slot() and self._room(len(self.suspended[0].tokens)):
            self.slots.resume(self.suspended.pop(0))

    @property
    def waiting(self) -> int:
        return len(self.suspended)

    # -- room for a step -----------------------------------------------------------------------------
    def before_step(self) -> int:
        """Cells this step's prompt chunks may take: what the context has free once idle slots
        gave their cached sequences up (least recently used first) for what the step wants,
        and the youngest running sequences theirs where the generating ones' next tokens would
        not fit (before llama.cpp has to say so)."""
        slots = self.slots
        n_gen = self._decoding()
        pending = sum(len(s.tokens) - s.done for s in slots.active if s.prefilling)
        self.make_room(n_gen + min(pending, max(0, slots.native.n_batch - n_gen)))
        while True:
            n_gen = self._decoding()
            free = slots.native.n_ctx - sum(self.held(s) for s in slots.slots)
            if free >= n_gen or not self._suspend_youngest():  # the running ones outgrew the context
                return max(0, free - n_gen)

    def _decoding(self) -> int:
        """Generating sequences with a token to decode this step (a grammar pass set aside has none)."""
        return sum(1 for s in self.slots.active if s.generating and not s.chain.pending)

    def make_room(self, need: int, tokens: list[int] | None = None) -> None:
        """Idle slots give their cells up, least recently used first, until `need` are free;
        those that share a prefix with `tokens` (cells a prompt is about to share) last."""
        slots = self.slots
        while slots.native.n_ctx - sum(self.held(s) for s in slots.slots) < need and self._give_way_one(tokens):
            pass

    def _give_way_one(self, tokens: list[int] | None = None) -> bool:
        """The least recently used idle slot's cached sequence gives its cells up; False when no
        idle slot holds any."""
        cached = [s for s in self.slots.slots if s.state is SlotState.CACHED]
        if not cached:
            return False
        live = self.slots.cache.live

        def last_out(s: Slot) -> tuple[bool, int]:
            return tokens is not None and lcp(live(s.id), tokens) >= MIN_REUSE, s.used

        self.give_way(min(cached, key=last_out))
        return True

    def give_way(self, slot: Slot) -> None:
        self.slots.cache.give_way(slot.id)
        slot.state = SlotState.IDLE
        self.slots.stats.given_way += 1

    def give_way_all(self) -> None:
        for slot in [s for s in self.slots.slots if s.state is SlotState.CACHED]:
            self.give_way(slot)

    def relieve(self) -> bool:
        """llama.cpp found no cells for the step: an idle slot gives its cells up, else the
        youngest running sequence that holds cells is suspended (not the last one: alone, a
        sequence always fits). False when neither can be done."""
        return self._give_way_one() or self._suspend_youngest()

    def _suspend_youngest(self) -> bool:
        # a grammar pass set aside (edge.model.constrained) holds its state in its chain: it samples
        # first, at the next step, and may be suspended after
        holding = [s for s in self.slots.active if s.slot is not None and self.held(s.slot) and not s.chain.pending]
        if len(holding) < 2:
            return False
        self.suspend(max(holding, key=lambda s: s.order))
        return True

    def unstick(self) -> bool:
        """A step with nothing to decode: prompts wait for cells that running prompts hold
        (every running sequence prefilling, none generating). The youngest gives its up; False
        when nothing runs."""
        return bool(self.slots.active) and self.relieve()

    # -- suspension ----------------------------------------------------------------------------------
    def suspend(self, seq: Sequence) -> None:
        """`seq` gives its cells up and waits at the head of the queue with what its slot held:
        its prompt and answer so far (and the token it was about to decode)."""
        slots, slot = self.slots, seq.slot
        assert slot is not None
        if seq.generating:
            seq.tokens = [*slots.cache.live(slot.id), seq.tok]
        slots.cache.suspend(slot.id)
        for f in seq.followers:  # they wait for this prefill: they wait with it
            f.leader = None
            self._park(f)
        seq.followers = []
        self._park(seq)
        slots.stats.suspended += 1

    def _park(self, seq: Sequence) -> None:
        self.slots.release(seq)
        seq.done, seq.plan, seq.chunk, seq.row = 0, None, 0, -1
        seq.suspensions += 1
        self.suspended.append(seq)
        self.suspended.sort(key=lambda s: s.order)

    def reap(self) -> None:
        """Suspended sequences whose request went away end without coming back."""
        for seq in [s for s in self.suspended if s.job.cancel.is_set()]:
            self._finish(seq, None)

    def end_all(self, error: BaseException | None) -> None:
        for seq in list(self.suspended):
            self._finish(seq, error)

    def _finish(self, seq: Sequence, error: BaseException | None) -> None:
        self.suspended.remove(seq)
        seq.chain.close()
        seq.sink.close(error)
