"""Continuous batching: `parallel` sequences of one llama.cpp context, one llama_decode per step
for all of them (DESIGN.md, "Serving many clients").

A request's choice takes a slot (a llama.cpp sequence id). Each step builds one batch: the next
token of every generating sequence first, then chunks of the prompts still to prefill, in the
order they came, up to n_batch tokens in all (chunked prefill: a long prompt holds the others'
tokens back by one chunk at most, and a prompt is never starved by decodes: each step leaves it
n_batch minus one token per generating sequence). After the decode each sequence samples from
its own logits row with its own sampler chain (edge.model.generate.SamplerChain), and its text
goes through the same Decoding as a sequence decoded alone. A sequence ends (stop, length,
cancelled by a disconnect or a drain, the request's time limit) at the step after, its slot free
for the next request; its cells stay as that slot's live sequence in the prompt cache until the
room is needed.

Cells: the KV cache is unified, n_ctx cells for every slot together. A sequence is admitted only
when its prompt and max_tokens fit beside what the running ones may still take, so a decode never
runs out of cells; idle slots' sequences give way (saved to the prompt cache first where worth it).

Choices of one prompt (`n` > 1) or equal prompts that arrive together are computed once: a
sequence whose prompt another slot is prefilling follows it, and takes its cells (seq_cp) and
samples from its logits row when that prefill ends.

LoRA adapters (issue 55): llama.cpp sets them per context, so one step decodes the sequences of
one adapter selection (edge.model.adapters); the selections with work take the steps in turns
(each at least every k-th step, k of them: none starves). An adapted sequence's cells hold what
its adapters computed: they are never shared (no prompt-cache reuse, no following across
selections) and are emptied when it ends.

Runs on the model's scheduler thread (edge.serve.worker), like every call into llama.cpp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from edge.model.candidates import Interrupted
from edge.model.generate import Decoding, Job, Piece, SamplerChain, step_check
from edge.model.native import DecodeError
from edge.model.promptcache import MIN_REUSE, lcp

if TYPE_CHECKING:
    from edge.model.checkpoints import PrefillCheckpoints
    from edge.model.native import Native
    from edge.model.promptcache import PromptCache

__all__ = ["Sink", "Slots", "SlotStats"]


class Sink(Protocol):
    """Where a sequence's pieces go (edge.serve.worker's channel): never blocks."""

    def put(self, piece: Piece) -> None: ...

    def close(self, error: BaseException | None) -> None: ...


@dataclass
class SlotStats:
    """Counters read by /metrics (plain ints, written on the scheduler thread)."""

    steps: int = 0
    batch_tokens: int = 0  # tokens decoded over all steps
    last_batch: int = 0  # tokens of the last step
    last_sequences: int = 0  # sequences in the last step
    batch_sequences: int = 0  # sequences over all steps
    sequences: int = 0  # sequences started
    shared_prompts: int = 0  # sequences that took another slot's prefill of their prompt
    decode_s: float = 0.0  # time in llama_decode
    sample_s: float = 0.0  # time sampling and making text, after the decodes


@dataclass(eq=False)
class _Seq:
    job: Job
    sink: Sink
    slot: int
    chain: SamplerChain
    out: Decoding
    need: int  # cells it may take: prompt + max_tokens
    done: int = 0  # prompt positions its sequence holds
    plan: PrefillCheckpoints | None = None
    leader: _Seq | None = None  # the sequence whose prefill of the same prompt it waits for
    followers: list[_Seq] = field(default_factory=list)
    generating: bool = False
    row: int = -1  # the batch row whose logits it samples after this step's decode
    chunk: int = 0  # prompt tokens of it in this step's batch
    tok: int = -1  # the token it decodes next
    stepped: bool = False  # in this step's batch (its adapter selection's turn)

    @property
    def key(self) -> tuple[tuple[str, int, float], ...]:
        return tuple((a.name, id(a), sc) for a, sc in self.job.adapters)


class Slots:
    """The sequences of one context and the step that decodes them together."""

    def __init__(self, native: Native, cache: PromptCache, n: int) -> None:
        self.native, self.cache, self.n = native, cache, n
        self.idle = list(range(n))  # free slots, least recently used first
        self.active: list[_Seq] = []  # in the order they came (prefill order)
        self.stats = SlotStats()
        self.turn: tuple[tuple[str, int, float], ...] | None = None  # the adapter selection of the last step

    # -- admission --------------------------------------------------------------------------------
    def fits(self, job: Job) -> bool:
        """Whether `job` can start now: a free slot, and cells for its prompt and max_tokens
        beside what the running sequences may still take."""
        return not self.active or (bool(self.idle) and self._reserved() + _need(job) <= self.native.n_ctx)

    def _reserved(self) -> int:
        return sum(s.need for s in self.active)

    def start(self, job: Job, sink: Sink) -> None:
        """`job` into a free slot (fits() said so): its prompt from the longest cached prefix, or
        following a slot that prefills the same prompt. An error goes to the sink."""
        job.hold.start()
        slot = self._pick(job.tokens)
        # cache_prompt: false alone in the context: every idle slot gives its cells up (saved to the
        # prompt cache first), so its batches span the same cells whatever ran before it and its
        # logprobs repeat bit for bit (docs/api.md "Reproducibility")
        alone = not job.cache_prompt and not self.active
        self._make_room(self.native.n_ctx if alone else _need(job), keep=slot)
        native = self.native
        native.seq = slot
        try:
            chain = SamplerChain(native, job.params)
        except Exception as exc:
            self.idle.append(slot)
            sink.close(exc)
            return
        seq = _Seq(job, sink, slot, chain, Decoding(native, job), _need(job))
        self.active.append(seq)
        self.stats.sequences += 1
        leader = next((s for s in self.active if s.leader is None and not s.generating and s is not seq
                       and job.cache_prompt and s.job.cache_prompt and s.job.tokens == job.tokens
                       and s.job.adapters == job.adapters), None)
        if leader is not None:
            seq.leader = leader
            leader.followers.append(seq)
            job.prefilled = True
            return
        self._begin(seq)

    def _begin(self, seq: _Seq) -> None:
        job = seq.job
        self.native.seq = seq.slot
        try:
            plain = not job.adapters  # an adapted prompt neither reuses nor leaves cells for others
            seq.done, seq.plan = self.cache.begin(job.tokens, job.cache_prompt and plain, job.remember and plain,
                                                  job.marks if plain else ())
        except Exception as exc:
            self._end(seq, exc)
            return
        job.cached_tokens, job.prefilled = seq.done, True

    def _pick(self, tokens: list[int]) -> int:
        """The free slot whose live sequence shares most of `tokens` (a conversation's next turn
        lands where its last one is), else the least recently used one."""
        lives = self.cache.lives

        def worth(slot: int) -> tuple[int, int]:
            n = lcp(lives.get(slot, []), tokens)
            return n if n >= MIN_REUSE else 0, -self.idle.index(slot)

        best = max(self.idle, key=worth)
        self.idle.remove(best)
        return best

    def _make_room(self, need: int, keep: int) -> None:
        """Idle slots' sequences give way (least recently used first) until `need` cells fit
        beside the running sequences and the idle ones left."""
        cache, native = self.cache, self.native
        held = self._reserved() + sum(len(cache.lives.get(s, [])) for s in self.idle) + len(cache.lives.get(keep, []))
        for s in list(self.idle):
            if held + need <= native.n_ctx:
                break
            native.seq = s
            held -= len(cache.live)
            cache.give_way()

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """One llama_decode for every sequence that has work, then their sampling; False when
        there was nothing to decode."""
        self._reap()
        batch = self._build()
        if not batch[0]:
            return False
        t0 = time.perf_counter()
        try:
            self.native.use_adapters(self._turn_adapters())
            self.native.decode_batch(*batch)
        except Exception as exc:  # DecodeError, or a native call that broke
            self._failed(exc)
            return True
        t1 = time.perf_counter()
        st = self.stats
        st.steps, st.batch_tokens, st.last_batch = st.steps + 1, st.batch_tokens + len(batch[0]), len(batch[0])
        st.decode_s += t1 - t0
        st.last_sequences = sum(1 for s in self.active if s.stepped)
        st.batch_sequences += st.last_sequences
        self._after_decode()
        st.sample_s += time.perf_counter() - t1
        return True

    def _reap(self) -> None:
        """Sequences whose request went away (disconnect, drain) end here, before the batch."""
        for seq in [s for s in self.active if s.job.cancel.is_set()]:
            self._end(seq, None)

    def _build(self) -> tuple[list[int], list[int], list[int], list[int]]:
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        out: list[int] = []
        turn = self._next_turn()
        for s in self.active:
            s.stepped = s.key == turn
        for s in self.active:  # decode before prefill: every generating sequence's next token
            if s.generating and s.stepped:
                s.row = len(tokens)
                tokens.append(s.tok)
                pos.append(s.out.pos)
                seqs.append(s.slot)
                out.append(1)
        budget = self.native.n_batch - len(tokens)
        for s in self.active:  # then prompt chunks, first come first
            s.chunk = 0
            if budget <= 0 or s.generating or s.leader is not None or not s.stepped:
                continue
            end = self._chunk_end(s, budget)
            n = end - s.done
            tokens += s.job.tokens[s.done:end]
            pos += range(s.done, end)
            seqs += [s.slot] * n
            out += [0] * (n - 1) + [1 if end == len(s.job.tokens) else 0]
            s.row = len(tokens) - 1 if end == len(s.job.tokens) else -1
            s.chunk, budget = n, budget - n
        return tokens, pos, seqs, out

    def _next_turn(self) -> tuple[tuple[str, int, float], ...] | None:
        """The adapter selection this step decodes: after the last one, in a fixed order, among
        those with work (one alone keeps every step)."""
        keys = sorted({s.key for s in self.active if s.generating or s.leader is None})
        if not keys:
            return None
        after = [k for k in keys if self.turn is not None and k > self.turn]
        self.turn = after[0] if after else keys[0]
        return self.turn

    def _turn_adapters(self) -> tuple[Any, ...]:
        return next((s.job.adapters for s in self.active if s.stepped), ())

    @staticmethod
    def _chunk_end(s: _Seq, budget: int) -> int:
        """Where this step's chunk of `s`'s prompt ends: the budget, and a checkpoint's position
        (its state is copied after the chunk that reaches it, so a chunk ends there)."""
        end = min(len(s.job.tokens), s.done + budget)
        wanted = [p for p in (s.plan.wanted if s.plan is not None else ()) if s.done < p < end]
        return min(wanted, default=end)

    def _after_decode(self) -> None:
        lives = self.cache.lives
        ready: list[_Seq] = []
        decoded = [s for s in self.active if s.generating and s.stepped]  # before followers join them
        prefilled = [s for s in self.active if not s.generating and s.chunk]
        for s in decoded:
            if not s.job.adapters:  # an adapted sequence's cells are no prefix for anyone
                lives.setdefault(s.slot, []).append(s.tok)
            s.out.pos += 1
            ready.append(s)
        for s in prefilled:
            self._prefilled_chunk(s, ready)
        # sampling without a grammar first: a slow grammar holds no other sequence's token back
        ready.sort(key=lambda s: s.chain.grammar is not None)
        for s in ready:
            self._sample(s)

    def _prefilled_chunk(self, s: _Seq, ready: list[_Seq]) -> None:
        """The step decoded a chunk of `s`'s prompt."""
        tokens = s.job.tokens
        s.done = end = s.done + s.chunk
        self.native.seq = s.slot
        if s.plan is not None:
            s.plan.after(end)
        if end < len(tokens):
            return
        self._prefilled(s)
        s.generating = True
        ready.append(s)
        for f in s.followers:  # the same prompt's cells, and its logits row
            self.native.seq = f.slot
            self.native.copy_from(s.slot, len(tokens))
            self._prefilled(f)
            f.leader, f.generating, f.row = None, True, s.row
            f.job.cached_tokens = len(tokens)
            self.stats.shared_prompts += 1
            ready.append(f)
        s.followers = []

    def _prefilled(self, s: _Seq) -> None:
        """The prompt cache told the slot holds the prompt; an adapted one's tokens kept from it."""
        self.cache.prefilled(s.job.tokens, s.job.marks)
        if s.job.adapters:
            self.cache.lives.pop(s.slot, None)

    def _sample(self, s: _Seq) -> None:
        try:
            tok = s.chain.sample(s.row, step_check(s.job))
            piece, done = s.out.take(tok, s.row)
        except Interrupted:  # cancelled inside its grammar pass: it ends, the others' step goes on
            self._end(s, None)
            return
        except Exception as exc:
            self._end(s, exc)
            return
        if piece is not None:
            s.sink.put(piece)
        if done:
            self._end(s, None)
        else:
            s.tok = tok if tok is not None else -1

    def _failed(self, exc: Exception) -> None:
        """A failed llama_decode: every sequence in it ends with the error, their cells emptied
        (their content is unknown)."""
        from edge.errors import BackendError

        err = BackendError(f"llama.cpp failed while generating: {exc}") if isinstance(exc, DecodeError) else exc
        for s in [s for s in self.active if s.stepped and (s.generating or s.chunk)]:
            self.native.seq = s.slot
            self.cache.reset()
            s.generating = False
            s.done = 0
            self._end(s, err)

    def _end(self, seq: _Seq, error: BaseException | None) -> None:
        """The sequence leaves its slot: its sampler freed, its consumer told, followers that
        waited for its prefill prefill themselves."""
        self.active.remove(seq)
        seq.chain.close()
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
        self.idle.append(seq.slot)
        if seq.job.adapters:  # its cells are its adapters' work: emptied, no one else's prefix
            self.native.seq = seq.slot
            self.cache.reset()
        elif not seq.generating and seq.leader is None and seq.done < len(seq.job.tokens):
            self.native.seq = seq.slot  # a prefill cut short: the slot holds only what was decoded
            self.cache.lives[seq.slot] = list(seq.job.tokens[:seq.done])
        seq.sink.close(error)
        for f in seq.followers:
            f.leader = None
            self._begin(f)
        seq.followers = []

    def end_all(self, error: BaseException | None) -> None:
        for seq in list(self.active):
            self._end(seq, error)

    @property
    def busy(self) -> int:
        return len(self.active)


def _need(job: Job) -> int:
    return len(job.tokens) + job.params.max_tokens

