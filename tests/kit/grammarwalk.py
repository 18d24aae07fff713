"""Random complete outputs of a compiled grammar, walked through llama.cpp's own grammar sampler
and edge's guard after it (edge.model.guard) without a model (tests/serve/test_schemaproperty.py).
At each step every byte token of the vocabulary (all 256: continuation bytes, overlong and
surrogate leads, bytes past U+10FFFF), its control tokens and the end of generation are offered;
llama.cpp says which the grammar allows, the guard which of those may come all the same, one is
drawn (favouring closing characters so that walks end) and accepted by both. What comes out is
exactly what a model sampling under the grammar could have written with those tokens, so every
way the grammar and its guard could let invalid text through is open to a walk.

Needs a model whose vocabulary has a token per byte (scripts/harness/ggufgen.py's tiny ones: `<0xNN>`).
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

__all__ = ["Walker", "accepts"]

_CLOSING = {ord(c): w for c, w in (('"', 6), ("}", 8), ("]", 8), (",", 2), ("0", 2), ("n", 2), ("t", 2),
                                    ("f", 2), ("-", 2), ("2", 2))}
_HIGH = 0.04  # the weight of one byte >= 0x80 (128 of them: about five ASCII characters together)


class Walker:
    def __init__(self, model: Any) -> None:
        from edge.model.guard import HIDDEN

        native = model.native
        lib = self.lib = native.lib
        self.table = model.tokens
        self.byte_tok: dict[int, int] = {}
        for tok in range(native.n_vocab):
            piece = native.piece(tok)
            if len(piece) == 1 and piece[0] not in self.byte_tok:
                self.byte_tok[piece[0]] = tok
        missing = [b for b in range(256) if b not in self.byte_tok]
        if missing:
            raise ValueError(f"the vocabulary has no token for bytes {missing[:5]}")
        self.eos = native.eos
        hidden = [t for t in range(native.n_vocab) if self.table.classify(t) & HIDDEN]
        self.ids = [self.byte_tok[b] for b in range(256)] + hidden + [self.eos]
        self.bytes_of = {t: b for b, t in self.byte_tok.items()}
        import numpy as np

        n = len(self.ids)
        self.np_ids = np.array(self.ids)
        self.data = (lib.llama_token_data * n)()
        self.array = lib.llama_token_data_array(self.data, n, -1, False)
        self.words = np.ctypeslib.as_array(self.data).view(np.int32).reshape(n, 3)  # id, logit, p
        self.pristine = np.zeros((n, 3), dtype=np.int32)
        self.pristine[:, 0] = self.ids
        self.logits = self.words[:, 1].view(np.float32)
        self.ptr = ctypes.cast(self.data, type(self.array.data))
        self.weights = np.array([self._weight(t) for t in self.ids])
        self.closing = np.array([self.bytes_of.get(t) in _CLOSING for t in self.ids], dtype=float)
        self.one = (lib.llama_token_data * 1)()
        self.one_array = lib.llama_token_data_array(self.one, 1, -1, False)

    def guard(self) -> Any:
        from edge.model.guard import OutputGuard

        return OutputGuard(self.table, json=True)

    def allowed(self, g: Any, guard: Any) -> Any:
        """Indices into self.ids the grammar allows next, and the guard after it."""
        self.words[...] = self.pristine  # llama.cpp may reorder: ids back in place
        a = self.array
        a.data, a.size, a.selected, a.sorted = self.ptr, len(self.ids), -1, False
        self.lib.llama_sampler_apply(g, ctypes.byref(a))
        allowed = (self.logits != float("-inf")).nonzero()[0]
        return allowed[~guard.veto(self.np_ids[allowed])] if len(allowed) else allowed

    def allows(self, g: Any, tok: int) -> bool:
        self.one[0].id, self.one[0].logit, self.one[0].p = tok, 0.0, 0.0
        a = self.one_array
        a.size, a.selected, a.sorted = 1, -1, False
        self.lib.llama_sampler_apply(g, ctypes.byref(a))
        return self.one[0].logit != float("-inf")

    def walk(self, compiled: Any, rng: random.Random, max_bytes: int = 300) -> bytes | None:
        """One complete output the grammar and its guard accept (the end of generation allowed
        after it); None where the walk ran past `max_bytes`. ValueError where they allow nothing
        at all before its end (a dead end: a grammar or guard bug)."""
        g, guard = compiled.clone(), self.guard()
        out = bytearray()
        try:
            while len(out) < max_bytes:
                allowed = self.allowed(g, guard)
                if not len(allowed):
                    raise ValueError(f"dead end after {bytes(out)!r}")
                weights = self.weights[allowed] * (1 + self.closing[allowed] * (len(out) / 40))
                tok = self.ids[rng.choices(allowed.tolist(), weights.tolist())[0]]
                if tok == self.eos:
                    return bytes(out)
                self.lib.llama_sampler_accept(g, tok)
                guard.accept(tok)
                out.append(self.bytes_of[tok])
            return None
        finally:
            self.lib.llama_sampler_free(g)

    def _weight(self, tok: int) -> float:
        if tok == self.eos:
            return 1000.0
        b = self.bytes_of.get(tok)
        if b is None:
            return 1.0  # a control token: the guard never lets it through
        return _HIGH if b >= 0x80 else float(_CLOSING.get(b, 1))


def accepts(walker: Walker, compiled: Any, text: str | bytes) -> bool:
    """Whether the grammar and its guard accept `text` whole, as a model would write it byte by
    byte, and then the end of generation."""
    g, guard = compiled.clone(), walker.guard()
    try:
        for b in text.encode("utf-8") if isinstance(text, str) else text:
            tok = walker.byte_tok[b]
            if not walker.allows(g, tok) or not guard.allows(tok):
                return False
            walker.lib.llama_sampler_accept(g, tok)
            guard.accept(tok)
        return walker.allows(g, walker.eos) and guard.allows(walker.eos)
    finally:
        walker.lib.llama_sampler_free(g)
