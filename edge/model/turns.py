"""LoRA adapter selections taking turns at the steps of one context (issue 55; edge.model.slots).

llama.cpp applies LoRA adapters per context (llama_set_adapters_lora): every sequence of one
llama_decode runs with the same set. So a step decodes the sequences of one selection (a
request's adapters and scales, edge.model.adapters; the base model's is the empty one), and the
selections with work take the steps in turns: the next one after the last step's, in a fixed
order, so each of k selections with work has at least every k-th step and none starves. One
selection alone (the usual case: no adapters at all) takes every step.

A step's turn is picked after admission has made room for it (edge.model.admission counts the
next token of every generating sequence, of whichever selection: it may make room a step early,
never too late).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.model.generate import Job

__all__ = ["SelectionKey", "Turns", "selection_of"]

# (name, the loaded adapter, scale) per adapter: a reload may load another file under the same
# name while the old set's requests drain with theirs, so the loaded object is part of the key
SelectionKey = tuple[tuple[str, int, float], ...]


def selection_of(job: Job) -> SelectionKey:
    """The selection `job` is decoded with: the empty key for the base model."""
    return tuple((a.name, id(a), scale) for a, scale in job.adapters)


class Turns:
    """Which selection each step of one context decodes (the scheduler thread only)."""

    def __init__(self) -> None:
        self.last: SelectionKey | None = None  # the selection of the last step

    def pick(self, working: Iterable[SelectionKey]) -> SelectionKey | None:
        """This step's selection among those of the sequences with work (`working`): the first
        after the last step's in a fixed order (wrapping round); None when none has work."""
        keys = sorted(set(working))
        if not keys:
            return None
        after = [k for k in keys if self.last is not None and k > self.last]
        self.last = after[0] if after else keys[0]
        return self.last
