"""Continuous batching: `parallel` sequences of one llama.cpp context, one llama_decode per step
for all of them (DESIGN.md, "Serving many clients").

A request's choice takes a slot (a llama.cpp sequence id, edge.model.sequence: its state an
enum). Each step builds one batch: the next token of every generating sequence first, then chunks
of the prompts still to prefill, in the order they came, up to n_batch tokens in all (chunked
prefill: a long prompt holds the others' tokens back by one chunk at most, and a prompt is never
starved by decodes: each step leaves it n_batch minus one token per generating sequence). After
the decode each sequence samples from its own logits row with its own sampler chain
(edge.model.generate.SamplerChain), and its text goes through the same Decoding as a sequence
decoded alone. A sequence ends (stop, length, cancelled by a disconnect or a drain, the request's
time limit) at the step after, its slot free for the next request; its cells stay as that slot's
live sequence in the prompt cache (CACHED) until the room is needed.

Cells (the KV cache is unified, n_ctx cells for every slot together) are taken as tokens are
decoded, not reserved up front: edge.model.admission decides who starts, which idle slots give
their cells up, and which sequence is suspended when the running ones outgrow the context.

Choices of one prompt (`n` > 1) or equal prompts that arrive together are computed once: a
sequence whose prompt another slot is prefilling follows it (WAITING), and takes its cells
(seq_cp) and samples from its logits row when that prefill ends.

LoRA adapters (issue 55): llama.cpp sets them per context, so one step decodes the sequences of
one adapter selection, and the selections with work take the steps in turns (edge.model.turns:
none starves). An adapted sequence's cells hold what its adapters computed: they are no prefix
for anyone (no prompt-cache reuse from them or into them, no slot sharing them with another
selection; the prompt cache keeps them private) and are emptied when it ends; suspended, it is
computed again from position 0 with the same adapters when it resumes.

Runs on the model's scheduler thread (edge.model.scheduler), like every call into llama.cpp.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from edge.model.admission import Admission
from edge.model.candidates import Interrupted
from edge.model.constrained import Deferred, StepBudget
from edge.model.generate import Decoding, Job, SamplerChain, step_check
from edge.model.native import DecodeError
from edge.model.promptcache import MIN_REUSE, lcp
from edge.model.sequence import Sequence, Sink, Slot, SlotState, SlotStats
from edge.model.speculate import Drafter, SpecStats
from edge.model.verify import build_batch, settle
from edge.model.turns import SelectionKey, Turns

if TYPE_CHECKING:
    from edge.model.native import Native
    from edge.model.promptcache import PromptCache
    from edge.config import SpeculativeConfig

__all__ = ["Sink", "Slots", "SlotStats"]


class Slots:
    """The sequences of one context and the step that decodes them together."""

    def __init__(self, native: Native, cache: PromptCache, n: int, spec: SpeculativeConfig | None = None) -> None:
        self.native, self.cache, self.n = native, cache, n
        self.spec = spec if spec is not None and spec.mode != "off" else None
        self.spec_stats = SpecStats()
        self.slots = [Slot(i) for i in range(n)]
        self.active: list[Sequence] = []  # holding a slot, in the order they came (prefill order)
        self.stats = SlotStats()
        self.admission = Admission(self)
        self.turns = Turns()
        self._order = 0

    @property
    def busy(self) -> int:
        """Slots running a request now."""
        return len(self.active)

    @property
    def pending(self) -> int:
        """Requests started and not ended: running, or suspended until cells come back."""
        return len(self.active) + self.admission.waiting

    @property
    def idle(self) -> list[int]:
        """The slots that take a request, least recently used first."""
        return [s.id for s in sorted(self.slots, key=lambda s: s.used) if s.state.free]

    def fits(self, job: Job) -> bool:
        """Whether `job` can start now (edge.model.admission)."""
        return self.admission.fits(job)

    # -- a sequence in and out of its slot -------------------------------------------------------------
    def start(self, job: Job, sink: Sink) -> None:
        """`job` into a free slot (fits() said so): its prompt from the longest cached prefix, or
        following a slot that prefills the same prompt. An error goes to the sink."""
        job.hold.start()
        try:
            chain = SamplerChain(self.native, job.params)
        except Exception as exc:
            sink.close(exc)
            return
        self._order += 1
        seq = Sequence(job, sink, chain, Decoding(self.native, job), self._order, list(job.tokens))
        if self.spec is not None:
            seq.drafter = Drafter(self.spec, job.tokens)
        self.stats.sequences += 1
        # cache_prompt: false alone in the context: every idle slot gives its cells up (saved to the
        # prompt cache first), so its batches span the same cells whatever ran before it and its
        # logprobs repeat bit for bit (docs/api.md "Reproducibility")
        if not job.cache_prompt and not self.active:
            self.admission.give_way_all()
        self._bind(seq, self._pick(seq.tokens, job))
        leader = next((s for s in self.active if s.prefilling and s is not seq and job.cache_prompt
                       and s.job.cache_prompt and s.tokens == seq.tokens and s.leader is None
                       and s.selection == seq.selection), None)
        if leader is not None:
            seq.leader = leader
            seq.slot.state = SlotState.WAITING
            leader.followers.append(seq)
            job.prefilled = True
            return
        self._begin(seq)

    def _bind(self, seq: Sequence, slot: Slot) -> None:
        seq.slot, slot.seq, slot.state = slot, seq, SlotState.PREFILLING
        self.active.append(seq)
        self.active.sort(key=lambda s: s.order)

    def _begin(self, seq: Sequence, resumed: bool = False) -> None:
        """The sequence's slot cut to the longest cached prefix of its tokens; the rest is
        prefilled by the steps. `resumed`: a suspended sequence back in a slot (its request's
        usage and the cache's counters stay as they were)."""
        job, slot = seq.job, seq.slot
        assert slot is not None
        slot.state = SlotState.PREFILLING
        plain = not job.adapters  # an adapted prompt starts from position 0 in cells of its own
        if not plain:
            self.cache.isolate(slot.id)
        # a restored state takes its cells at once (its slot's own are freed first)
        self.admission.make_room(len(seq.tokens) - lcp(self.cache.live(slot.id), seq.tokens),
                                 seq.tokens if plain else None)
        try:
            seq.done, seq.plan = self.cache.begin(slot.id, seq.tokens, job.cache_prompt and plain,
                                                  job.remember and plain, () if resumed or not plain else job.marks,
                                                  count=not resumed and plain)
        except Exception as exc:
            self._end(seq, exc)
            return
        if not resumed:
            job.cached_tokens, job.prefilled = seq.done, True

    def resume(self, seq: Sequence) -> None:
        """A suspended sequence (edge.model.admission) back in a free slot: its prompt and what it
        generated so far restored from the state saved when it gave its cells up (or computed
        again), then it samples on as if nothing had happened."""
        seq.out.pos = len(seq.tokens)
        self._bind(seq, self._pick(seq.tokens, seq.job))
        self._begin(seq, resumed=True)

    def _pick(self, tokens: list[int], job: Job | None = None) -> Slot:
        """The free slot whose live sequence shares most of `tokens` (a conversation's next turn
        lands where its last one is), else an empty one, else the least recently used one. An
        adapted `job` shares nothing: an empty slot, else the least recently used."""
        lives = self.cache.lives
        if job is not None and job.adapters:
            tokens = []

        def worth(slot: Slot) -> tuple[int, bool, int]:
            n = lcp(lives.get(slot.id, []), tokens)
            return n if n >= MIN_REUSE else 0, slot.state is SlotState.IDLE, -slot.used

        return max((s for s in self.slots if s.state.free), key=worth)

    @contextlib.contextmanager
    def spare(self, tokens: list[int] | None = None, need: int = 0) -> Iterator[int]:
        """A free slot's id for work outside the steps (a sequence decoded alone, prefix states
        restored or saved), on the scheduler thread between steps: the one `tokens` would
        land on, with `need` cells for it (other idle slots give theirs up); its state follows
        what its cells hold afterwards."""
        if not any(s.state.free for s in self.slots):
            raise RuntimeError(f"every one of the {self.n} slots is running a request")
        slot = self._pick(tokens or [])
        slot.state = SlotState.PREFILLING  # taken meanwhile: admission counts its cells as a request's
        self.native.use_adapters(())  # the base model's, unless the work sets its own (GGUFModel.generate)
        self.admission.make_room(need)
        try:
            yield slot.id
        finally:
            slot.used = self.stats.steps
            slot.state = SlotState.CACHED if self.cache.live(slot.id) else SlotState.IDLE

    def forget(self) -> None:
        """Every idle slot's cells given up, nothing saved (a fresh start for a test or a
        benchmark; the saved states are the prompt cache's to clear)."""
        for slot in self.slots:
            if slot.state.free:
                self.cache.reset(slot.id)
                slot.state = SlotState.IDLE

    def release(self, seq: Sequence) -> None:
        """The sequence leaves its slot (ended or suspended): CACHED where its cells hold
        tokens, else IDLE."""
        slot = seq.slot
        self.active.remove(seq)
        if slot is None:
            return
        seq.slot = slot.seq = None
        slot.used = self.stats.steps
        slot.state = SlotState.CACHED if self.cache.live(slot.id) else SlotState.IDLE

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """One llama_decode for every sequence that has work, then their sampling; False when
        there was nothing to decode."""
        t = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.step_s += time.perf_counter() - t

    def _step(self) -> bool:
        self._reap()
        self.admission.resume_suspended()
        budget = self.admission.before_step()
        turn = self.turns.pick(s.selection for s in self.active if s.has_work(budget))
        batch = build_batch(self.active, turn, budget, self.native.n_batch, self.spec)
        if not batch[0]:
            return self._sample_set_aside() or self.admission.unstick()
        t0 = time.perf_counter()
        try:
            self.native.use_adapters(next(s.job.adapters for s in self.active if s.stepped))
            self.native.decode_batch(*batch)
        except DecodeError as exc:
            if exc.rc == 1 and self.admission.relieve():  # no cells: nothing was decoded; again next step
                self.stats.retried += 1
                return True
            self._failed(exc, turn)
            return True
        except Exception as exc:  # a native call that broke
            self._failed(exc, turn)
            return True
        t1 = time.perf_counter()
        st = self.stats
        st.steps, st.batch_tokens, st.last_batch = st.steps + 1, st.batch_tokens + len(batch[0]), len(batch[0])
        st.decode_s += t1 - t0
        st.last_sequences = sum(1 for s in self.active if s.stepped)
        st.batch_sequences += st.last_sequences
        self._after_decode(t1 - t0)
        st.sample_s += time.perf_counter() - t1
        return True

    def _reap(self) -> None:
        """Sequences whose request went away (disconnect, drain) end here, before the batch."""
        for seq in [s for s in self.active if s.job.cancel.is_set()]:
            self._end(seq, None)
        self.admission.reap()

    def _after_decode(self, decode_s: float) -> None:
        lives = self.cache.lives
        ready: list[Sequence] = []
        decoded = [s for s in self.active if s.generating and s.stepped]  # before followers join them
        prefilled = [s for s in self.active if s.prefilling and s.chunk]
        for s in decoded:
            lives.setdefault(s.slot.id, []).append(s.tok)
            s.out.pos += 1
            ready.append(s)
        for s in prefilled:
            self._prefilled_chunk(s, ready)
        ready += [s for s in self.active if s.chain.pending]  # passes set aside at an earlier step
        self._sample_ready(ready, decode_s)

    def _sample_ready(self, ready: list[Sequence], decode_s: float) -> None:
        """Sampling without a grammar first, then the grammar passes set aside before, then the
        others, within the step's grammar budget (edge.model.constrained.StepBudget): a slow
        grammar holds no other sequence's token back, and stretches the step by its budget at most."""
        budget = StepBudget(decode_s, lambda: len(self.active) > 1)
        ready.sort(key=lambda s: (s.chain.grammar is not None, not s.chain.pending))
        for s in ready:
            self._sample(s, budget if s.chain.grammar is not None else None)

    def _sample_set_aside(self) -> bool:
        """No token to decode: the grammar passes set aside go on (False: none)."""
        pending = [s for s in self.active if s.chain.pending]
        self._sample_ready(pending, 0.0)
        return bool(pending)

    def _prefilled_chunk(self, s: Sequence, ready: list[Sequence]) -> None:
        """The step decoded a chunk of `s`'s prompt."""
        tokens, slot = s.tokens, s.slot
        s.done = end = s.done + s.chunk
        self.cache.lives[slot.id] = list(tokens[:end])
        if s.plan is not None:
            s.plan.after(end)
        if end < len(tokens):
            return
        self.cache.prefilled(slot.id, tokens, s.job.marks)
        slot.state = SlotState.GENERATING
        ready.append(s)
        for f in s.followers:  # the same prompt's cells, and its logits row
            self.cache.copy(slot.id, f.slot.id, len(tokens))
            self.cache.prefilled(f.slot.id, tokens, f.job.marks)
            f.leader, f.slot.state, f.row, f.done = None, SlotState.GENERATING, s.row, len(tokens)
            f.job.cached_tokens = len(tokens)
            self.stats.shared_prompts += 1
            ready.append(f)
        s.followers = []

    def _sample(self, s: Sequence, budget: StepBudget | None = None) -> None:
        """`s`'s next token from its row; then, while the token picked is the proposal decoded
        after it, the proposal's row in turn (edge.model.speculate). The cells of the proposals
        not taken are dropped before the sequence goes on or ends."""
        draft, rows, slot = s.draft, s.draft_rows, s.slot
        s.draft, s.draft_rows = [], []
        accepted, tok, done = 0, None, True
        try:
            while True:
                tok = s.chain.sample(s.row, step_check(s.job, budget))
                piece, done = s.out.take(tok, s.row, s.chain.saved)
                if piece is not None:
                    s.sink.put(piece)
                if done or tok is None:
                    break
                if s.drafter is not None:
                    s.drafter.push(tok)
                if accepted >= len(draft) or tok != draft[accepted]:
                    break
                self.cache.lives.setdefault(slot.id, []).append(tok)  # its cells hold it: decoded with the step
                s.out.pos, s.row = s.out.pos + 1, rows[accepted]
                accepted += 1
        except Deferred:  # its pass goes on at the next step, first of the passes
            return
        except Interrupted:  # cancelled inside its grammar pass: it ends, the others' step goes on
            self._end(s, None)
            return
        except Exception as exc:
            self._end(s, exc)
            return
        finally:
            settle(self.native, self.spec_stats, s, slot, draft, accepted)
        if done:
            self._end(s, None)
        else:
            s.tok = tok if tok is not None else -1

    def _failed(self, exc: Exception, turn: SelectionKey | None) -> None:
        """A failed llama_decode: every sequence of its selection that was in it ends with the error,
        their cells emptied (their content is unknown)."""
        from edge.errors import BackendError

        err = BackendError(f"llama.cpp failed while generating: {exc}") if isinstance(exc, DecodeError) else exc
        for s in [s for s in self.active if s.selection == turn and (s.generating or s.chunk)]:
            self.cache.reset(s.slot.id)
            s.done = 0
            self._end(s, err)

    def _end(self, seq: Sequence, error: BaseException | None) -> None:
        """The sequence leaves its slot: its sampler freed, its consumer told, followers that
        waited for its prefill prefill themselves."""
        seq.chain.close()
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
            seq.leader = None
        elif seq.prefilling and seq.slot is not None:  # a prefill cut short: the slot holds only what was decoded
            self.cache.lives[seq.slot.id] = list(seq.tokens[:seq.done])
        if seq.slot is not None and seq.slot.id in self.cache.private:  # its adapters' cells: no one's prefix
            self.cache.reset(seq.slot.id)
        self.release(seq)
        seq.sink.close(error)
        for f in seq.followers:
            f.leader = None
            self._begin(f)
        seq.followers = []

    def end_all(self, error: BaseException | None) -> None:
        for seq in list(self.active):
            self._end(seq, error)
        self.admission.end_all(error)
