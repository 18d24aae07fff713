"""Speculative decoding from a sequence's own context (prompt lookup): the tokens that followed
the same n tokens earlier in the prompt or the answer are proposed as the sequence's next ones,
and the step that decodes its next token (edge.model.slots, through edge.model.verify) decodes the proposals with it, in the
same llama_decode as every other sequence of the step, with logits for every row.

Verification is sampling: the sequence's own sampler chain picks a token from each row in turn,
and a proposal is accepted while it is the token picked. For a draft that is one fixed token
(q a point mass) this is the standard rejection rule exactly: the draft token t is kept with
probability p(t), and when it is not, the token picked is a draw from p with t left out and
renormalised. Greedy keeps a proposal where it is the argmax. So the text is the target's own,
with or without speculation: the chain sees the same rows and is advanced by the same tokens (its
penalties, grammar and seeded draws included); only rejected proposals' cells are dropped
(llama_memory_seq_rm for that sequence's positions after its last accepted token).

Proposals cost rows of the step's decode. A sequence proposes few tokens at first (START_DRAFT)
and more while they are all kept, back to what was kept after a step that was not. A sequence whose accepted share falls below the floor
stops proposing for a while (doubling each time, so a copy-heavy stretch later in a long answer
is still found), and a step stops adding proposals once its decode rows reach `max_step_rows`: a
full batch is compute-bound, and a rejected row then costs about what an accepted one saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.config import SpeculativeConfig

__all__ = ["Drafter", "SpecStats"]

PAUSE_STEPS = 16  # steps without proposals after the acceptance fell below the floor (doubled each time)
MAX_PAUSE_STEPS = 1024
START_DRAFT = 2  # a sequence's first proposals: this many tokens, growing while they are kept


class SpecStats:
    """A model's counters (read by /metrics and `edge status`)."""

    def __init__(self) -> None:
        self.drafted = 0  # tokens proposed
        self.accepted = 0  # of those, the tokens the target picked too
        self.steps = 0  # sequence-steps that verified at least one proposal
        self.paused = 0  # times a sequence stopped proposing (acceptance under the floor)


class Drafter:
    """One sequence's proposals: an index from each n-gram of its tokens (prompt, then answer) to
    where the token after its latest occurrence is, extended as tokens come."""

    def __init__(self, cfg: SpeculativeConfig, prompt: list[int]) -> None:
        self.cfg = cfg
        self.tokens = list(prompt)
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(cfg.ngram_min, cfg.ngram_max + 1)}
        self._indexed = 0
        self.drafted = self.accepted = 0  # since the last judgement
        self._pause = 0  # steps left without proposals
        self._next_pause = PAUSE_STEPS
        # how many tokens it proposes now: doubled after a step that kept them all, cut to what was
        # kept (and one more) after one that did not; a run of failures costs one row a step, not max_draft
        self.size = min(START_DRAFT, cfg.max_draft)

    def push(self, tok: int) -> None:
        """A token of the answer (sampled, or a proposal accepted)."""
        self.tokens.append(tok)

    def _extend(self) -> None:
        h, end = self.tokens, len(self.tokens)
        for n, index in self._index.items():
            for i in range(max(n, self._indexed), end):
                index[tuple(h[i - n:i])] = i  # the latest occurrence wins
        self._indexed = end

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest n-gram the sequence ends with, where it
        occurred before (the latest occurrence); [] where none did or proposals are paused."""
        limit = min(limit, self.size)
        if limit <= 0:
            return []
        if self._pause > 0:
            self._pause -= 1
            return []
        self._extend()
        h = self.tokens
        for n in range(self.cfg.ngram_max, self.cfg.ngram_min - 1, -1):
            if len(h) <= n:
                continue
            at = self._index[n].get(tuple(h[-n:]))
            if at is not None and at < len(h):
                return h[at:at + limit]
        return []

    def judge(self, drafted: int, accepted: int, stats: SpecStats) -> None:
        """A step's verdict on its proposals: below the floor after min_drafted tokens, a pause."""
        self.drafted += drafted
        self.accepted += accepted
        cfg = self.cfg
        self.size = min(cfg.max_draft, 2 * self.size) if accepted == drafted else accepted + 1
        if self.drafted < cfg.min_drafted:
            return
        if self.accepted < cfg.min_acceptance * self.drafted:
            self._pause, self._next_pause = self._next_pause, min(MAX_PAUSE_STEPS, 2 * self._next_pause)
            stats.paused += 1
        else:
            self._next_pause = PAUSE_STEPS
        self.drafted = self.accepted = 0

