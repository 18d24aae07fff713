"""The candidate arrays llama.cpp's samplers work on (`llama_token_data_array`), for sampling
under a grammar (edge.model.generate.SamplerChain).

- The whole vocabulary with its logits, refilled from the last decoded logits in two numpy
  copies per token, as llama.cpp's own sampling fills it.
- One candidate, to ask the grammar about the token the chain picked without it (llama.cpp's
  common sampler does the same). Greedy without penalties picks it from the model's logits
  themselves (a view; one copy where there is a logit bias to add), with no array to fill.
- The likeliest candidates alone, to find greedy's token under the grammar when the grammar
  rejected its first choice: the grammar's verdict on a token does not depend on the other
  candidates, so if an allowed token among the k likeliest is likelier than every token
  outside them, it is the one the grammar over the whole vocabulary leads greedy to (of equal
  logits, the lowest id: greedy's first in vocabulary order). k is each of TOPS in turn; the
  whole vocabulary is asked only where none decides.
- A pass over the whole vocabulary that its `check` ended goes on from the same chunk at the
  next call (a step's grammar budget, edge.model.constrained), and a filled array's verdicts can
  be kept (`snapshot`) and filled again less the tokens the guard after the grammar turned down.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["CHUNK", "CHUNK_S", "MIN_CHUNK", "Candidates", "Interrupted", "TOPS"]

# candidates the grammar goes over between two looks at the clock (`check`): a request's
# deadline, a drain or a client that left ends a full pass within one chunk's time instead of
# the whole pass's. The grammar's cost per candidate grows with its stacks (edge.serve.schema.stacks
# bounds them) and with the candidate's text, unevenly: under 256 look-alike objects one chunk of
# 8,192 of Gemma 3's candidates took 85 ms on average and 0.96 s at most (loaded 2-core VM). So
# the chunk adapts: sized for CHUNK_S from the last one's time, between MIN_CHUNK and CHUNK.
CHUNK = 8192
MIN_CHUNK = 256
CHUNK_S = 0.02


class Interrupted(Exception):
    """A sampling step ended by its `check` (the job was cancelled) in the middle of a pass."""

# how many of the likeliest candidates the grammar is asked about, in turn, when greedy's own
# choice was rejected: JSON's next token is mostly among the first 64; digits after a key, or
# a string's closing quote, can lie further down
TOPS = (64, 1024, 16384)


class Candidates:
    def __init__(self, native: Native, bias: list[tuple[int, float]] | None = None) -> None:
        import numpy as np

        lib, n = native.lib, native.n_vocab
        self._bias_ids = np.array([t for t, _ in bias or ()], dtype=np.int64)
        self._bias = np.array([b for _, b in bias or ()], dtype=np.float32)
        self._biased = np.empty(n, dtype=np.float32) if bias else None
        self._np, self._n, self._apply, self._lib = np, n, lib.llama_sampler_apply, lib
        self._data = (lib.llama_token_data * n)()
        words = np.ctypeslib.as_array(self._data).view(np.int32).reshape(n, 3)  # id, logit, p
        words[:, 0] = np.arange(n, dtype=np.int32)
        self._pristine = words.copy()  # ids, and p = 0: copied back whole before every fill
        self._words, self._logits = words, words[:, 1].view(np.float32)
        self._array = lib.llama_token_data_array(self._data, n, -1, False)
        self._ref = ctypes.byref(self._array)
        self._data_ptr = ctypes.cast(self._data, ctypes.c_void_p).value
        self._tops = [k for k in TOPS if k < n]
        self._chunk = CHUNK // 4  # candidates of the grammar's next chunk (apply_grammar adapts it)
        self._at: int | None = None  # where a pass that `check` ended goes on
        big = max(self._tops, default=1)
        self._top = (lib.llama_token_data * big)()
        self._top_words = np.ctypeslib.as_array(self._top).view(np.int32).reshape(big, 3)
        self._top_array = lib.llama_token_data_array(self._top, big, -1, False)
        self._top_ref = ctypes.byref(self._top_array)
        self._one = lib.llama_token_data(0, 0.0, 0.0)
        self._one_array = lib.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)
        self._one_ref = ctypes.byref(self._one_array)

    def _row(self, logits: Any) -> Any:
        """A logits row as numpy: the model's (a ctypes pointer, valid until the next decode) or a
        copy kept across steps (an array)."""
        if isinstance(logits, self._np.ndarray):
            return logits
        return self._np.ctypeslib.as_array(logits, shape=(self._n,))

    def fill(self, logits: Any) -> Any:
        """Every token with its logit, in vocabulary order; a reference for llama_sampler_apply."""
        a = self._array
        self._words[...] = self._pristine  # samplers reorder and shrink the array: ids back in place
        self._logits[...] = self._row(logits)
        a.data = ctypes.cast(self._data_ptr, type(a.data))
        a.size, a.selected, a.sorted = self._n, -1, False
        self._at = None
        return self._ref

    def ban(self, ids: Any) -> None:
        """`ids` out of the filled array (it must be as fill() left it, in vocabulary order)."""
        self._logits[ids] = float("-inf")

    def allowed_ids(self) -> Any:
        """The tokens of the filled array (as fill() and the samplers before the chain left it)
        not at -inf: what the grammar allows."""
        return self._np.flatnonzero(self._logits != float("-inf"))

    def copy_row(self, logits: Any) -> Any:
        """A copy of a logits row that outlives the next decode (fill() and biased() take it)."""
        return self._row(logits).copy()

    @property
    def ref(self) -> Any:
        """The filled array, for llama_sampler_apply."""
        return self._ref

    def snapshot(self) -> Any:
        """A copy of the filled array's logits, to fill() it again as it is now."""
        return self._logits.copy()

    def selected(self) -> int | None:
        """The token the chain picked; None where it could pick only a banned one (-inf)."""
        a = self._array
        if not 0 <= a.selected < a.size:
            return None
        chosen = a.data[a.selected]
        return None if chosen.logit == float("-inf") else int(chosen.id)

    def allows(self, grammar: Any, tok: int) -> bool:
        """Whether the grammar, as it stands, allows `tok` next."""
        one, a = self._one, self._one_array
        one.id, one.logit, one.p = tok, 1.0, 0.0
        a.size, a.selected, a.sorted = 1, -1, False
        self._apply(grammar, self._one_ref)
        return one.logit != float("-inf")

    def apply_grammar(self, grammar: Any, check: Callable[[], None] | None) -> None:
        """The grammar over the filled array (as fill() and the samplers before it left it), a
        CHUNK of candidates at a time, `check` called between chunks (it raises to end the
        step). The grammar's verdict on a candidate does not depend on the others, so the
        chunks give what one pass over the whole array gives. Where `check` raises, the pass
        can go on from that chunk by calling this again before the next fill() (a step's
        grammar budget, edge.model.constrained)."""
        a = self._array
        if check is None or a.size <= MIN_CHUNK:
            self._apply(grammar, self._ref)
            return
        part = self._lib.llama_token_data_array(a.data, 0, -1, False)
        base, size, width = ctypes.cast(a.data, ctypes.c_void_p).value, a.size, ctypes.sizeof(self._lib.llama_token_data)
        start = self._at or 0
        while start < size:
            self._at = start
            check()
            n = min(self._chunk, size - start)
            part.data = ctypes.cast(base + start * width, type(a.data))
            part.size, part.selected, part.sorted = n, -1, False
            t0 = time.perf_counter()
            self._apply(grammar, ctypes.byref(part))
            took = time.perf_counter() - t0
            self._chunk = max(MIN_CHUNK, min(CHUNK, int(n * CHUNK_S / max(took, 1e-6))))
            start += n
        self._at = None
        a.sorted = False

    def biased(self, logits: Any) -> Any:
        """The model's logits with the logit bias added, as llama.cpp's logit-bias sampler adds
        it (in order, float32; a token named twice gets both): a numpy view of the logits
        themselves where there is no bias, else one copy."""
        np = self._np
        raw = self._row(logits)
        if self._biased is None:
            return raw
        self._biased[...] = raw
        np.add.at(self._biased, self._bias_ids, self._bias)
        return self._biased

    def filled(self) -> Any:
        """The filled array's logits (bias and penalties applied) while it is as fill() left it
        (greedy only sets `selected`); else None."""
        a = self._array
        intact = a.size == self._n and ctypes.cast(a.data, ctypes.c_void_p).value == self._data_ptr
        return self._logits if intact else None

    @property
    def tops(self) -> list[int]:
        return self._tops

    def greedy_among(self, grammar: Any, all_logits: Any, k: int, veto: Callable[[Any], Any] | None = None) -> int | None:
        """Greedy's token under the grammar from `logits` (every token's, in vocabulary order),
        asking the grammar about the `k` likeliest alone; None where they do not decide it (no
        allowed one, or the best allowed one no likelier than a token outside them). `veto(ids)`
        marks allowed tokens that may not come all the same (edge.model.guard)."""
        np = self._np
        ids = np.sort(np.argpartition(all_logits, -k)[-k:])  # vocabulary order: greedy's tie-break
        logits = all_logits[ids]
        floor = logits.min()  # no token outside `ids` has a larger logit
        words = self._top_words[:k]
        words[:, 0], words[:, 2] = ids, 0
        top_logits = words[:, 1].view(np.float32)
        top_logits[...] = logits
        t = self._top_array
        t.data = ctypes.cast(ctypes.addressof(self._top), type(t.data))
        t.size, t.selected, t.sorted = k, -1, False
        self._apply(grammar, self._top_ref)
        allowed = top_logits != float("-inf")  # the grammar's verdict: rejected ones are -inf
        if veto is not None and allowed.any():
            where = np.flatnonzero(allowed)
            allowed[where[veto(ids[where])]] = False
        if not allowed.any():
            return None
        best = logits[allowed].max()
        if not best > floor:
            return None
        return int(ids[np.flatnonzero(allowed & (logits == best))[0]])
