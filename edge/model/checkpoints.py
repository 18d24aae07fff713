"""Checkpoints for sliding-window models: the states one prefill keeps, so that a later prompt
that shares only a part of this one still continues from that part.

With `swa_full = false` (llama.cpp's and llama-server's default) llama.cpp keeps only the last
window of each sliding-window layer, in a cache of the window plus a batch of cells, and
llama_state_seq_get_data saves only what the last position sees: such a state can be continued
from its end and nowhere else. A state copied whole (Native.state_bytes(whole=True)) holds all
that the live sequence holds, so it can be cut back as far as the live sequence could: to the
start while the prompt fits llama.cpp's window cache (1,024 cells for Gemma 3 at the default
batch), else at least a batch back from its end (the end of the prompt's last full batch, a few
tokens before its end). A position further back needs a state copied earlier in the prefill.

So while a prompt is prefilled, the state is copied after the batch that reaches each position a
later prompt is likely to continue from: the prompt's end, and where its chat template starts a
user turn (after the system message, before the last user message), a copy kept only where the
end's state does not reach back there -- never a second prefill, and the batches are the same
with or without copies. Measured on Gemma 3 270M at n_ctx 2048 (docs/internals.md, "Prompt cache"): a whole state is
14.5 MiB at 824 tokens and 21 MiB at 2,000; a copy takes 2-4 ms (4-14 ms into fresh pages on the
busy 2-core machine). Hence: a prefill of fewer than MIN_NEW tokens copies nothing (the copy
would be a tenth of its time, and the states it continued from are kept); the end's copy makes
room (least recently used states out), an earlier one takes only room that is free, at most one
per prompt; a copy the end's state gives all of is dropped when the end's is kept.

Runs on the model's worker thread, inside Native.decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
__all__ = ["MIN_NEW", "PrefillCheckpoints", "positions"]

MIN_NEW = 128  # tokens: a state is copied only for at least this many that no saved state gives


def positions(start: int, end: int, marks: Iterable[int]) -> list[int]:
    """Where a prefill of tokens[start:end] keeps a state: its end and the marks inside it."""
    return sorted({end, *(m for m in marks if start < m < end)})


class PrefillCheckpoints:
    """The copies one prefill takes: `after` is Native.decode's hook. `copy(end, evict)` keeps the
    live state (positions up to end - 1) in the prompt cache, evicting others for it or only in
    free room, and answers whether it could."""

    def __init__(self, wanted: Iterable[int], end: int, copy: Callable[[int, bool], bool]) -> None:
        self.end, self.copy = end, copy
        self.wanted = sorted(wanted)
        self.taken: list[int] = []  # where copies were taken

    def after(self, end: int) -> None:
        reached = [p for p in self.wanted if p <= end]
        self.wanted = self.wanted[len(reached):]
        if end < self.end and (not reached or self.taken):
            return  # one earlier copy at most
        if reached and self.copy(end, end == self.end):
            self.taken.append(end)
