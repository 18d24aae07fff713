"""Random complete outputs of a compiled grammar, walked through llama.cpp's own grammar sampler
without a model (tests/serve/test_schemaproperty.py): at each step llama.cpp says which next
bytes (ASCII, a few multi-byte characters) and whether the end of generation the grammar
allows; one is drawn, favouring closing characters so that walks end, and accepted. What comes
out is exactly what a model sampling under the grammar could have written with those tokens.

Needs a model whose vocabulary has a token per byte (scripts/harness/ggufgen.py's tiny ones: `<0xNN>`).
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

__all__ = ["Walker", "accepts"]

_MULTI = ["é", "ß", "名", "€", "😀"]  # multi-byte characters a walk may write (one per length)
_CLOSING = {ord(c): w for c, w in (('"', 6), ("}", 8), ("]", 8), (",", 2), ("0", 2), ("n", 2), ("t", 2),
                                    ("f", 2), ("-", 2), ("2", 2))}


class Walker:
    def __init__(self, native: Any) -> None:
        lib = self.lib = native.lib
        self.byte_tok = {}
        for tok in range(native.n_vocab):
            piece = native.piece(tok)
            if len(piece) == 1 and piece[0] not in self.byte_tok and native.piece(tok) == piece:
                self.byte_tok[piece[0]] = tok
        missing = [b for b in range(128) if b not in self.byte_tok]
        if missing:
            raise ValueError(f"the vocabulary has no token for bytes {missing[:5]}")
        self.eos = native.eos
        self.firsts = sorted({*range(128), *(c.encode()[0] for c in _MULTI)} & set(self.byte_tok))
        self.ids = [self.byte_tok[b] for b in self.firsts] + [self.eos]
        import numpy as np

        n = len(self.ids)
        self.data = (lib.llama_token_data * n)()
        self.array = lib.llama_token_data_array(self.data, n, -1, False)
        self.words = np.ctypeslib.as_array(self.data).view(np.int32).reshape(n, 3)  # id, logit, p
        self.pristine = np.zeros((n, 3), dtype=np.int32)
        self.pristine[:, 0] = self.ids
        self.logits = self.words[:, 1].view(np.float32)
        self.ptr = ctypes.cast(self.data, type(self.array.data))
        self.one = (lib.llama_token_data * 1)()
        self.one_array = lib.llama_token_data_array(self.one, 1, -1, False)

    def allowed(self, g: Any) -> list[int]:
        """Indices into self.ids the grammar allows next."""
        self.words[...] = self.pristine  # llama.cpp may reorder: ids back in place
        a = self.array
        a.data, a.size, a.selected, a.sorted = self.ptr, len(self.ids), -1, False
        self.lib.llama_sampler_apply(g, ctypes.byref(a))
        return (self.logits != float("-inf")).nonzero()[0].tolist()

    def allows(self, g: Any, tok: int) -> bool:
        self.one[0].id, self.one[0].logit, self.one[0].p = tok, 0.0, 0.0
        a = self.one_array
        a.size, a.selected, a.sorted = 1, -1, False
        self.lib.llama_sampler_apply(g, ctypes.byref(a))
        return self.one[0].logit != float("-inf")

    def walk(self, compiled: Any, rng: random.Random, max_bytes: int = 300) -> bytes | None:
        """One complete output the grammar accepts (the end of generation allowed after it);
        None where the walk ran past `max_bytes`. ValueError where the grammar allows nothing
        at all before its end (a dead end: a grammar bug)."""
        g = compiled.clone()
        out = bytearray()
        try:
            while len(out) < max_bytes:
                allowed = self.allowed(g)
                if not allowed:
                    raise ValueError(f"dead end after {bytes(out)!r}")
                weights = [self._weight(i, len(out)) for i in allowed]
                pick = rng.choices(allowed, weights)[0]
                if self.ids[pick] == self.eos:
                    return bytes(out)
                seq = self._sequence(self.firsts[pick], rng)
                for k, b in enumerate(seq):
                    if k and not self.allows(g, self.byte_tok[b]):
                        return None  # the first byte was allowed for another character
                    self.lib.llama_sampler_accept(g, self.byte_tok[b])
                    out.append(b)
            return None
        finally:
            self.lib.llama_sampler_free(g)

    def _weight(self, i: int, length: int) -> float:
        if self.ids[i] == self.eos:
            return 1000.0
        return _CLOSING.get(self.firsts[i], 1) * (1 + length / 40 if self.firsts[i] in _CLOSING else 1)

    @staticmethod
    def _sequence(first: int, rng: random.Random) -> bytes:
        if first < 128:
            return bytes([first])
        return rng.choice([c for c in _MULTI if c.encode()[0] == first]).encode()


def accepts(walker: Walker, compiled: Any, text: str) -> bool:
    """Whether the grammar accepts `text` whole, as a model would write it byte by byte, and then
    the end of generation."""
    g = compiled.clone()
    try:
        for b in text.encode("utf-8"):
            tok = walker.byte_tok[b]
            if not walker.allows(g, tok):
                return False
            walker.lib.llama_sampler_accept(g, tok)
        return walker.allows(g, walker.eos)
    finally:
        walker.lib.llama_sampler_free(g)
