"""What a grammar cannot hold a generation to, checked after it, per token: the client gets
strict UTF-8, exactly the text the grammar read, and (for a JSON schema's grammar) JSON whose
objects never repeat a key.

llama.cpp's grammar reads a token's text leniently: its UTF-8 decoder takes overlong forms
(`C0 AF` as `/`), surrogates (`ED A0 A0` as U+D800), values past U+10FFFF, and within one
token any byte after a lead byte as a continuation (`C3 41` is one character); it reads a
control token by its name (`<start_of_turn>`, 15 characters) where the client gets nothing, and
a token's text only up to a NUL byte. So `{"maxLength": 1}` took `ED A0 A0` (one "character",
three U+FFFD for the client), reached with `logit_bias`. And a grammar cannot say "a key not
written before in this object" (`additionalProperties` and free objects took `{"x": 1, "x": 2}`).

`OutputGuard` follows the text the client gets, byte by byte: UTF-8 as Unicode's table of
well-formed byte sequences has it (a partial character at a token's end is fine, its next bytes
must complete it), and, in JSON mode, each object's keys as decoded (`"a/"` and `"a\\/"` are one
key). `allows(tok)` says whether a token may come next; most tokens need no byte-by-byte look
(whole UTF-8, no quote: `TokenTable` keeps each token's class, found the first time it is asked).
End of generation is allowed only on a whole character (the grammar decides the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["EOG", "HIDDEN", "OutputGuard", "QUOTE", "TokenTable", "WHOLE"]

# a token's class bits: KNOWN classified; WHOLE its text is UTF-8 on its own; PREFIX it starts
# well-formed UTF-8 after a whole character (maybe ending inside one); CONT it starts with a
# continuation byte; QUOTE it holds `"`; HIDDEN the grammar reads other text than the client gets;
# EOG it ends the generation
KNOWN, WHOLE, PREFIX, CONT, QUOTE, HIDDEN, EOG = 1, 2, 4, 8, 16, 32, 64
_ESCAPES = {ord('"'): '"', ord("\\"): "\\", ord("/"): "/", ord("b"): "\b", ord("f"): "\f", ord("n"): "\n",
            ord("r"): "\r", ord("t"): "\t"}


def utf8_after(need: int, lo: int, hi: int, piece: bytes) -> tuple[int, int, int] | None:
    """The UTF-8 state (continuation bytes still due, the next one's range) after `piece`,
    from the state (need, lo, hi); None where a byte breaks well-formed UTF-8 (Unicode's table
    3-7: no overlong form, no surrogate, nothing past U+10FFFF)."""
    for b in piece:
        if need:
            if not lo <= b <= hi:
                return None
            need, lo, hi = need - 1, 0x80, 0xBF
        elif b >= 0x80:
            if 0xC2 <= b <= 0xDF:
                need = 1
            elif 0xE0 <= b <= 0xEF:
                need = 2
                lo, hi = (0xA0, 0xBF) if b == 0xE0 else (0x80, 0x9F) if b == 0xED else (0x80, 0xBF)
            elif 0xF0 <= b <= 0xF4:
                need = 3
                lo, hi = (0x90, 0xBF) if b == 0xF0 else (0x80, 0x8F) if b == 0xF4 else (0x80, 0xBF)
            else:
                return None
    return need, lo, hi


class TokenTable:
    """Each token's class (the bits above), found on first need and kept. HIDDEN: a control or
    unknown token (the grammar reads its name, the client gets nothing), a NUL byte (the grammar
    reads up to it) or no text. One per model; used on the model's thread only."""

    def __init__(self, native: Native) -> None:
        import numpy as np

        self.np, self._native = np, native
        lib = native.lib
        self._attr, self._vocab = lib.llama_vocab_get_attr, native.vocab
        self._hide = lib.LLAMA_TOKEN_ATTR_UNKNOWN | lib.LLAMA_TOKEN_ATTR_CONTROL
        self.flags = np.zeros(native.n_vocab, dtype=np.uint8)

    def piece(self, tok: int) -> bytes:
        """The token's text as the client gets it."""
        return self._native.piece(tok)

    def classify(self, tok: int) -> int:
        f = int(self.flags[tok])
        if f:
            return f
        native = self._native
        if native.is_eog(tok):
            f = KNOWN | EOG
        else:
            piece = native.piece(tok)
            f = KNOWN | (QUOTE if b'"' in piece else 0)
            if self._attr(self._vocab, tok) & self._hide or b"\0" in piece or not piece:
                f |= HIDDEN
            after = utf8_after(0, 0x80, 0xBF, piece)
            f |= (PREFIX if after is not None else 0) | (WHOLE if after is not None and not after[0] else 0)
            f |= CONT if piece and 0x80 <= piece[0] <= 0xBF else 0
        self.flags[tok] = f
        return f

    def classes(self, ids: Any) -> Any:
        """The classes of the tokens `ids` (a numpy array), classifying those not known yet."""
        flags = self.flags[ids]
        for i in self.np.flatnonzero(flags == 0):
            flags[i] = self.classify(int(ids[i]))
        return flags


class _State:
    """Where the text is: a partial UTF-8 character, the JSON containers open, a string."""

    __slots__ = ("need", "lo", "hi", "stack", "expect_key", "in_str", "is_key", "esc", "hexs", "key", "raw")

    def __init__(self) -> None:
        self.need, self.lo, self.hi = 0, 0x80, 0xBF  # continuation bytes still due, the next one's range
        self.stack: list[frozenset[str] | None] = []  # per open container: an object's keys so far, or None
        self.expect_key = False  # the next string opens a key
        self.in_str = self.is_key = False
        self.esc = 0  # 1 after a backslash, 2..5: \u hex digits still due
        self.hexs = ""
        self.key: list[str] = []  # the key read so far (escapes decoded)
        self.raw = bytearray()  # its raw bytes since the last escape

    def copy(self) -> _State:
        out = _State.__new__(_State)
        for name in _State.__slots__:
            setattr(out, name, getattr(self, name))
        out.stack, out.key, out.raw = list(self.stack), list(self.key), bytearray(self.raw)
        return out

    def json(self, b: int) -> bool:
        """Byte `b` of JSON text (which the grammar holds to JSON's syntax); False where it closes a
        key its object already has."""
        if self.in_str:
            return self._string(b)
        if b == 0x22:  # "
            self.in_str, self.is_key = True, self.expect_key
            self.key, self.raw = [], bytearray()
        elif b == 0x7B:  # {
            self.stack.append(frozenset())
            self.expect_key = True
        elif b == 0x5B:  # [
            self.stack.append(None)
            self.expect_key = False
        elif b in (0x7D, 0x5D):  # } ]
            if self.stack:
                self.stack.pop()
            self.expect_key = False
        elif b == 0x2C:  # ,
            self.expect_key = bool(self.stack) and self.stack[-1] is not None
        elif b == 0x3A:  # :
            self.expect_key = False
        return True

    def _string(self, b: int) -> bool:
        if self.esc == 1:
            if b == 0x75:  # u
                self.esc, self.hexs = 5, ""
            else:
                self._decoded(_ESCAPES.get(b, ""))
                self.esc = 0
        elif self.esc:
            self.hexs += chr(b)
            self.esc = 0 if self.esc == 2 else self.esc - 1
            if not self.esc:
                self._decoded(chr(int(self.hexs, 16)) if all(c in "0123456789abcdefABCDEF" for c in self.hexs) else "")
        elif b == 0x5C:  # backslash
            self.esc = 1
        elif b == 0x22:  # the closing quote
            self.in_str = False
            if self.is_key:
                return self._key_closed()
        elif self.is_key:
            self.raw.append(b)
        return True

    def _decoded(self, text: str) -> None:
        if self.is_key:
            self.key += [self.raw.decode("utf-8", "surrogatepass"), text]
            self.raw = bytearray()

    def _key_closed(self) -> bool:
        self._decoded("")
        key = "".join(self.key).encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")  # pairs joined
        top = self.stack[-1] if self.stack else None
        self.is_key = self.expect_key = False
        if top is None:
            return True
        if key in top:
            return False
        self.stack[-1] = top | {key}
        return True


class OutputGuard:
    """One generation's text, as the client gets it: `allows(tok)` before a token is taken,
    `accept(tok)` after. `json`: the text is a JSON value (a schema's grammar): no repeated key."""

    def __init__(self, table: TokenTable, json: bool) -> None:
        self.table, self.json = table, json
        self.state = _State()

    def allows(self, tok: int) -> bool:
        f, st = self.table.classify(tok), self.state
        if f & HIDDEN:
            return False
        if f & EOG:
            return not st.need
        if not (f & CONT if st.need else f & PREFIX):
            return False  # a continuation byte due and not given, or one given where none is due
        if not (self.json and f & QUOTE):  # no key can close: the UTF-8 is all there is to look at
            return not st.need or utf8_after(st.need, st.lo, st.hi, self.table.piece(tok)) is not None
        return self._feed(st.copy(), self.table.piece(tok))

    def accept(self, tok: int) -> None:
        if not self.table.classify(tok) & EOG:
            self._feed(self.state, self.table.piece(tok))

    def veto(self, ids: Any) -> Any:
        """For the tokens `ids` (a numpy array): True where allows() says no, read from their
        classes where they say it (a look at the text only for the few they do not)."""
        flags = self.table.classes(ids)
        np, st = self.table.np, self.state
        eog = (flags & EOG) != 0
        out = (flags & HIDDEN) != 0
        if st.need:
            out |= eog | ((flags & CONT) == 0)
            look = ~out
        else:
            out |= ~eog & ((flags & PREFIX) == 0)
            look = ~out & ((flags & QUOTE) != 0) if self.json else np.zeros_like(out)
        for i in np.flatnonzero(look):
            out[i] = not self.allows(int(ids[i]))
        return out

    def _feed(self, state: _State, piece: bytes) -> bool:
        after = utf8_after(state.need, state.lo, state.hi, piece)
        if after is None:
            return False
        state.need, state.lo, state.hi = after
        return not self.json or all(state.json(b) for b in piece)
