"""What a cached prefix is, made without the prompt cache's own machinery: the state a request
leaves behind, computed fresh from its prompt, for tests that hold an answer continued from the
cache to the answer it must be, bit for bit.

Why bit for bit and against this, not "within a bound" of a fresh prefill of the whole prompt:
llama.cpp promises that the same computation gives the same floats (same build, threads, batch
shapes), and nothing across batch shapes or KV layouts. An answer continued from a cached state
differs from a fresh prefill in two ways that depend on the CPU's kernels, not on edge: the
prefix was computed in the batches of the request that left it (which rows a kernel computes
together: an AVX-512 build's Q4_K kernels round differently by batch, an AVX2 build's did not
here), and a restored state brings its KV cells back in another order (attention sums them in
another order). How far apart that leaves the two (logprobs 6e-4 on the tiny model with one CPU's
kernels, 1.1e-3 with another's; Gemma's greedy text parting at a near-tie) is llama.cpp's on that
CPU: docs/api.md "Reproducibility". What edge decides (which state, cut where, restored how) is
held exactly by comparing with `left_by`.
"""

from __future__ import annotations

from edge.model.llm import GGUFModel
from edge.model.promptcache import Entry

__all__ = ["left_by"]


def left_by(m: GGUFModel, prompt: list[int], seq: int = 0) -> None:
    """The model's prompt cache emptied, then holding only what a request for `prompt` leaves
    in it: that prompt's state computed from position 0 in sequence `seq` in llama.cpp's batches
    of n_batch (as its prefill ran them), saved as the cache saves a state (a sliding-window
    model's whole where there is one slot, so that it can be cut back: Native.whole_states). The
    next request that shares a prefix with it restores and cuts it as the cache does with a
    checkpoint."""
    m.cache.clear()
    for s in range(m.native.n_seq):
        m.cache.reset(s)
    n = m.native
    n.decode(seq, prompt, 0)
    whole = bool(n.n_swa) and n.whole_states
    entry = Entry(list(prompt), n.state_bytes(seq, whole), whole=whole,
                  pos_min=n.pos_min(seq) if whole else n.window_min(seq))
    m.cache.reset(seq)
    assert m.cache.add(entry)
