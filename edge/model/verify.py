"""A step's proposals (edge.model.speculate) in and out of its batch: each generating sequence's
proposals decoded after its next token, with logits for every row, and afterwards the cells of
the ones its sampler chain did not take dropped (edge.model.slots samples the rows in turn)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.config import SpeculativeConfig
    from edge.model.native import Native
    from edge.model.sequence import Sequence, Slot
    from edge.model.speculate import SpecStats

__all__ = ["add_drafts", "settle"]

Batch = tuple[list[int], list[int], list[int], list[int]]  # tokens, positions, sequence ids, logits wanted


def add_drafts(spec: SpeculativeConfig | None, active: list[Sequence], batch: Batch, room: int, n_batch: int) -> int:
    """Each generating sequence's proposals after its next token (already in `batch`), while the
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
        if s.drafter is None or not s.generating or s.chain.pending or s.slot is None:
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
