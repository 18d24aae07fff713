"""Saved states of a sliding-window model that can be cut back, in any slot (edge.model.promptcache).

llama.cpp saves a sequence's state (llama_state_seq_get_data) with its sliding-window layers'
cells only as far back as its last position sees (n_swa): such a state continues from its end
and nowhere else. A context with several sequences has no other per-sequence state (the whole
context's, llama_state_get_data, holds every slot), and the cells a finished sequence leaves in
the window cache are reused for other sequences' tokens as soon as the window no longer shows
them. So a prompt that parts from an earlier one a few tokens before that one's end (a long
prefix and a novel question) would find nothing to continue from.

Beside the end's state a second piece is kept: the sequence's first c = L - n_swa positions
shared into the context's spare sequence (seq_cp: no copy), everything before c - n_swa dropped,
and that saved: every layer's cells of [c - n_swa, c), which the window at c sees. Restored, the
end's state goes into the slot and the piece into the spare sequence, whose positions then
replace the slot's there (seq_rm, seq_cp): the slot holds every layer's cells from c - n_swa on
and can be cut back to any n >= c - 1, i.e. within the last n_swa + 1 positions of its end.
The piece costs n_swa positions of KV (Gemma 3 270M: ~9 MiB beside the end's ~10 MiB at 824
tokens); a state of at most n_swa positions needs none (nothing of it is masked).

Runs on the model's scheduler thread, between llama_decode calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["cut_piece", "splice_piece"]


def cut_piece(native: Native, seq: int, n: int) -> tuple[bytearray, int] | None:
    """(the piece, its first position) for sequence `seq` holding positions 0 .. n - 1, or None
    where its end's state needs none (no sliding window, or n <= n_swa) or it holds nothing
    more (its window cells before c are gone already)."""
    n_swa = native.n_swa
    c = n - n_swa
    lo = max(0, c - n_swa, native.pos_min(seq))
    if not n_swa or c <= 0 or lo >= c - 1:
        return None
    spare = native.spare
    native.copy(seq, spare, c)
    try:
        if lo:
            native.drop(spare, 0, lo)
        return native.state_bytes(spare), lo
    finally:
        native.clear(spare)


def splice_piece(native: Native, seq: int, piece: bytearray, lo: int, c: int) -> bool:
    """The piece's positions [lo, c) into `seq`, which holds the end's state: False (the slot
    as it was) where llama.cpp refuses the piece."""
    spare = native.spare
    if not native.set_state(spare, piece):
        return False
    native.drop(seq, lo, c)
    native.share(spare, seq, lo, c)
    native.clear(spare)
    return True
