"""A step's batch (edge.model.slots): the next token of every generating sequence of the step's
adapter selection, its proposals (edge.model.speculate) after it with logits for every row, then
chunks of the prompts still to prefill; afterwards the cells of the proposals its sampler chain
did not take dropped (edge.model.slots samples the rows in turn)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.config import SpeculativeConfig
    from edge.model.native import Native
    from edge.model.sequence import Sequence, Slot
    from edge.model.speculate import SpecStats
    from edge.model.turns import SelectionKey

__all__ = ["Batch", "add_drafts", "build_batch", "chunk_end", "settle"]

Batch = tuple[list[int], list[int], list[int], list[int]]  # tokens, positions, sequence ids, logits wanted


def build_batch(active: list[Sequence], turn: SelectionKey | None, budget: int, n_batch: int,
                spec: SpeculativeConfig | None) -> Batch:
    """The step's batch, of the sequences of the adapter selection `turn` (marked `stepped`):
    decode before prefill, every generating sequence's next token and its proposals, then prompt
    chunks, first come first, within the cells (`budget`) and n_batch."""
    tokens: list[int] = []
    pos: list[int] = []
    seqs: list[int] = []
    out: list[int] = []
    for s in active:
        s.chunk, s.stepped = 0, False
    mine = [s for s in active if s.selection == turn]
    for s in mine:
        if s.generating and not s.chain.pending:  # (a grammar pass set aside has none yet)
            s.row, s.stepped = len(tokens), True
            tokens.append(s.tok)
            pos.append(s.out.pos)
            seqs.append(s.slot.id)
            out.append(1)
    budget -= add_drafts(spec, active, (tokens, pos, seqs, out), budget, n_batch)
    budget = min(budget, n_batch - len(tokens))
    for s in mine:
        if budget <= 0 or not s.prefilling:
            continue
        end = chunk_end(s, budget)
        n = end - s.done
        tokens += s.tokens[s.done:end]
        pos += range(s.done, end)
        seqs += [s.slot.id] * n
        out += [0] * (n - 1) + [1 if end == len(s.tokens) else 0]
        s.row = len(tokens) - 1 if end == len(s.tokens) else -1
        s.chunk, s.stepped, budget = n, True, budget - n
    return tokens, pos, seqs, out


def chunk_end(s: Sequence, budget: int) -> int:
    """Where this step's chunk of `s`'s prompt ends: the budget, and a checkpoint's position
    (its state is copied after the chunk that reaches it, so a chunk ends there)."""
    end = min(len(s.tokens), s.done + budget)
    wanted = [p for p in (s.plan.wanted if s.plan is not None else ()) if s.done < p < end]
    return min(wanted, default=end)


def add_drafts(spec: SpeculativeConfig | None, active: list[Sequence], batch: Batch, room: int, n_batch: int) -> int:
    """Each generating sequence's proposals after its next token (already in `batch`: `stepped`,
    of the step's adapter selection), while the
    step's decode rows stay within max_step_rows and the cells (`room`) and the batch have room;
    the cells they take."""
    tokens, pos, seqs, out = batch
    for s in active:
        s.draft, s.draft_rows = [], []
    if spec is None:
        return 0
    rows = min(spec.max_step_rows, n_batch)
    taken = 0
    for s in active:
        if s.drafter is None or not s.stepped or not s.generating or s.chain.pending or s.slot is None:
            continue
        left = s.job.params.max_tokens - s.job.completion_tokens - 1  # the next token's own row counts one
        draft = s.drafter.propose(min(spec.max_draft, left, rows - len(tokens), room - taken))
        if not draft:
            continue
        s.draft, s.draft_rows = draft, list(range(len(tokens), len(tokens) + len(draft)))
        tokens += draft
        pos += range(s.out.pos + 1, s.out.pos + 1 + len(draft))
        seqs += [s.slot.id] * len(draft)
        out += [1] * len(draft)
        taken += len(draft)
    return taken


def settle(native: Native, stats: SpecStats, s: Sequence, slot: Slot | None, draft: list[int], accepted: int) -> None:
    """A step's proposals of `s` judged, the cells of those not taken dropped (positions from the
    one after its last accepted token on)."""
    if not draft or slot is None:
        return
    if accepted < len(draft):
        native.drop(slot.id, s.out.pos, -1)
    stats.drafted, stats.accepted, stats.steps = stats.drafted + len(draft), stats.accepted + accepted, stats.steps + 1
    if s.drafter is not None:
        s.drafter.judge(len(draft), accepted, stats)
