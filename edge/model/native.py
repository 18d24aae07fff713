"""llama.cpp itself, through llama-cpp-python's C bindings: one model, its context and its batch,
and every native call edge makes on them.

edge does not use llama-cpp-python's high-level `Llama` class: it owns the generation loop
(edge.model.generate) and the KV cache (edge.model.promptcache), so the class's per-token Python (logit
copies, a Python sampler for logit bias, a single-prefix cache) is gone, and so are its settings
that differ from llama.cpp's and llama-server's own defaults (flash attention forced off,
sliding-window layers kept at full size). What is left is a thin layer over `llama.h` whose every
call runs on the model's worker thread; ctypes releases the GIL during each call, so the event
loop runs meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edge.model.kvtypes import GGML_TYPES

__all__ = ["ContextSettings", "DecodeError", "Native", "FLASH_ATTN"]

log = logging.getLogger("edge")

# config value -> llama_flash_attn_type (llama.h): "auto" lets llama.cpp decide per device and
# model, as llama-server does by default.
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
SEQ = 0  # the sequence a one-slot context decodes into


class DecodeError(RuntimeError):
    """llama_decode failed: `rc` is its return code (1: no cells for the batch, nothing decoded;
    -1: a batch llama.cpp refuses; others: a compute error), also in the message."""

    def __init__(self, message: str, rc: int = 0) -> None:
        super().__init__(message)
        self.rc = rc


@dataclass(frozen=True)
class ContextSettings:
    """Everything that shapes the loaded model and its context (from a ModelConfig)."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    n_threads_batch: int
    flash_attn: str  # a key of FLASH_ATTN
    swa_full: bool  # sliding-window layers keep every position (True) or only their window
    n_gpu_layers: int
    use_mmap: bool
    use_mlock: bool
    use_extra_bufts: bool = True  # llama.cpp's weight repacking / AMX buffers (false: --no-repack)
    n_seq: int = 1  # sequence slots sharing the context's cells (unified KV): requests decoded at once
    # the KV cache's element types (issue 55): names of edge.model.kvtypes.GGML_TYPES
    type_k: str = "f16"
    type_v: str = "f16"


@functools.cache
def _lib() -> Any:
    """llama_cpp's bindings, the backend initialised once per process, llama.cpp's own log
    through edge's callback: errors only, capped and rate-limited (edge.model.nativelog)."""
    import llama_cpp

    from edge.model.nativelog import install_log_callback

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    install_log_callback()
    llama_cpp.llama_backend_init()
    return llama_cpp


class Native:
    """One loaded model and its context. Not thread-safe: use from the model's worker thread.

    The context holds `n_seq` sequences in one unified KV cache (slots share n_ctx cells, so a
    single long request can use all of them). Every operation that touches a sequence (decode,
    keep, clear, copy, states, ...) takes its id as its first argument: nothing remembers which
    sequence was worked on last; `decode_batch` decodes tokens of many sequences in one
    llama_decode."""

    def __init__(self, path: str, s: ContextSettings, quiet: bool = False) -> None:
        """`quiet`: a process's own start, nothing else in llama.cpp yet: its log goes to memory
        while it loads (edge.model.nativelog.quiet_load), not through the GIL."""
        self.lib = _lib()
        if not quiet:
            self._open(path, s)
            return
        from edge.model.nativelog import quiet_load

        try:
            with quiet_load() as q:
                self._open(path, s)
        except ValueError as exc:  # the log's error lines are there once the block has ended
            raise ValueError(f"{exc}: {'; '.join(q.errors[-2:])}" if q.errors else str(exc)) from None

    def _open(self, path: str, s: ContextSettings) -> None:
        lib = self.lib
        self.settings = s
        self.model = self.ctx = None
        self._batch: Any = None
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = s.n_gpu_layers
        mp.use_extra_bufts = s.use_extra_bufts
        mp.load_mode = {(True, True): lib.LLAMA_LOAD_MODE_MMAP_MLOCK, (True, False): lib.LLAMA_LOAD_MODE_MMAP,
                        (False, True): lib.LLAMA_LOAD_MODE_MLOCK,
                        (False, False): lib.LLAMA_LOAD_MODE_NONE}[(s.use_mmap, s.use_mlock)]
        self.model = lib.llama_model_load_from_file(path.encode(), mp)  # the GIL is released
        if not self.model:
            raise ValueError(f"Failed to load model from file: {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        cp = _context_params(lib, s)
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise ValueError(f"llama.cpp could not create a context of {s.n_ctx} tokens for {path}")
        self.params = cp
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.n_batch = int(lib.llama_n_batch(self.ctx))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        # sliding-window attention: how far back a token attends. With swa_full too: llama.cpp then
        # keeps every position in a full-size window cache, but still leaves what the window no
        # longer shows out of a sequence's state and reuses those cells once the cache wraps
        self.n_swa = int(lib.llama_model_n_swa(self.model))
        self.n_seq = max(1, s.n_seq)  # the slots: sequence ids 0 .. n_seq - 1
        # a sequence id no slot uses, for work that must not touch a slot's cells (a piece of a
        # state cut out, edge.model.windowed); empty between such calls
        self.spare = self.n_seq
        # a state of every position the window cache holds needs the whole context's state
        # (llama_state_get_data): only where the context has one slot (the spare one is empty)
        self.whole_states = self.n_seq == 1
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._rows = [SEQ] * self.n_batch  # each batch row's sequence id, rewritten only where it changes
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = SEQ
        self._tok, self._pos, self._out = self._batch.token, self._batch.pos, self._batch.logits
        self._piece = ctypes.create_string_buffer(256)
        self._lora: tuple[tuple[Any, float], ...] = ()  # the adapters set on the context (issue 55)
        # a Native dropped without close() (a load failing half-way) still frees what it holds
        self._free = weakref.finalize(self, _free, lib, self.model, self.ctx, self._batch)

    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """Fewer (or again all) threads, e.g. while a reload's new set warms up beside this one."""
        s = self.settings
        self.lib.llama_set_n_threads(self.ctx, min(n_threads, s.n_threads), min(n_threads_batch, s.n_threads_batch))

    def use_adapters(self, sel: tuple[tuple[Any, float], ...]) -> None:
        """The context's LoRA adapters made `sel` ((adapter, scale), each adapter with its
        llama.cpp `handle`; empty: none) for the decodes that follow; nothing where it is already."""
        if len(sel) == len(self._lora) and all(a is b and s == t for (a, s), (b, t) in zip(sel, self._lora)):
            return
        lib, n = self.lib, len(sel)
        handles = (lib.llama_adapter_lora_p_ctypes * n)(*[a.handle for a, _ in sel]) if n else None
        scales = (ctypes.c_float * n)(*[s for _, s in sel]) if n else None
        if lib.llama_set_adapters_lora(self.ctx, handles, n, scales):
            raise DecodeError(f"llama.cpp could not set {n} LoRA adapters on the context")
        self._lora = sel

    # -- vocabulary ------------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        n_max = len(text) + 8
        buf = (ctypes.c_int32 * n_max)()
        n = self.lib.llama_tokenize(self.vocab, text, len(text), buf, n_max, add_bos, special)
        if n < 0:  # never more tokens than bytes plus specials, but llama.h says how many
            buf = (ctypes.c_int32 * -n)()
            n = self.lib.llama_tokenize(self.vocab, text, len(text), buf, -n, add_bos, special)
        if n < 0:
            raise ValueError(f"llama.cpp could not tokenize a text of {len(text)} bytes")
        return buf[:n]

    def piece(self, tok: int, special: bool = False) -> bytes:
        """One token's bytes (pieces of a multi-byte character are partial UTF-8)."""
        n = self.lib.llama_token_to_piece(self.vocab, tok, self._piece, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, tok, big, -n, 0, special)
            return big.raw[:n]
        return ctypes.string_at(self._piece, n)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return b"".join(self.piece(t, special) for t in tokens)

    @property
    def bos(self) -> int:
        return int(self.lib.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(self.lib.llama_vocab_eos(self.vocab))

    def is_eog(self, tok: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, tok))

    # -- decoding ----------------------------------------------------------------------------------
    def decode(self, seq: int, tokens: Sequence[int], pos: int, after: Callable[[int], None] | None = None) -> None:
        """`tokens` at positions pos, pos+1, ... into sequence `seq`, n_batch at a time; logits
        only for the last token (what sampling needs). `after(end)` runs after each batch, the
        sequence then holding positions up to end - 1 (the batches are the same with it or
        without it)."""
        b, n_batch, i32 = self._batch, self.n_batch, ctypes.c_int32
        for i in range(0, len(tokens), n_batch):
            chunk = tokens[i:i + n_batch]
            n = len(chunk)
            self._set_rows(0, n, seq)
            ctypes.memmove(self._tok, (i32 * n)(*chunk), 4 * n)
            ctypes.memmove(self._pos, (i32 * n)(*range(pos + i, pos + i + n)), 4 * n)
            ctypes.memset(self._out, 0, n)
            self._out[n - 1] = 1 if i + n == len(tokens) else 0
            b.n_tokens = n
            self._check(self.lib.llama_decode(self.ctx, b), pos + i, n)
            if after is not None:
                after(pos + i + n)

    def decode_one(self, seq: int, tok: int, pos: int) -> None:
        self._set_rows(0, 1, seq)
        self._tok[0], self._pos[0], self._out[0] = tok, pos, 1
        self._batch.n_tokens = 1
        rc = self.lib.llama_decode(self.ctx, self._batch)
        if rc:
            self._check(rc, pos, 1)

    def decode_batch(self, tokens: list[int], pos: list[int], seqs: list[int], out: list[int]) -> None:
        """One llama_decode of tokens of several sequences: row i is `tokens[i]` at `pos[i]` of
        sequence `seqs[i]`, with its logits computed where `out[i]` (read with logits(i))."""
        n, i32, rows = len(tokens), ctypes.c_int32, self._rows
        seq_id = self._batch.seq_id
        for i, s in enumerate(seqs):
            if rows[i] != s:
                rows[i] = seq_id[i][0] = s
        ctypes.memmove(self._tok, (i32 * n)(*tokens), 4 * n)
        ctypes.memmove(self._pos, (i32 * n)(*pos), 4 * n)
        ctypes.memmove(self._out, (ctypes.c_int8 * n)(*out), n)
        self._batch.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, self._batch)
        if rc:
            self._check(rc, min(pos), n)

    def _set_rows(self, start: int, end: int, seq: int) -> None:
        rows, seq_id = self._rows, self._batch.seq_id
        for i in range(start, end):
            if rows[i] != seq:
                rows[i] = seq_id[i][0] = seq

    @staticmethod
    def _check(rc: int, pos: int, n: int) -> None:
        if rc == 0:
            return
        why = {1: "no room in the KV cache", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
        raise DecodeError(f"llama_decode of {n} tokens at position {pos} returned {rc} ({why})", rc)

    def logits(self, idx: int = -1) -> Any:
        """Batch row `idx`'s logits (the last row's by default) as a numpy view (valid until the
        next decode)."""
        import numpy as np

        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))

    # -- a sequence's KV cache ---------------------------------------------------------------------
    def keep(self, seq: int, n: int) -> bool:
        """Drop every position of `seq` from n on; False where the memory cannot (recurrent models)."""
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq, n, -1))

    def copy(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` made to hold sequence `src`'s first n positions (their cells shared, not
        computed again: llama_memory_seq_cp)."""
        lib = self.lib
        lib.llama_memory_seq_rm(self.mem, dst, -1, -1)
        lib.llama_memory_seq_cp(self.mem, src, dst, 0, n)

    def drop(self, seq: int, p0: int, p1: int) -> None:
        """Positions [p0, p1) of `seq` removed (llama_memory_seq_rm)."""
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """`src`'s cells of positions [p0, p1) made `dst`'s too (llama_memory_seq_cp: no copy)."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def pos_min(self, seq: int) -> int:
        """The oldest position `seq` still holds (-1: empty)."""
        return int(self.lib.llama_memory_seq_pos_min(self.mem, seq))

    def pos_max(self, seq: int) -> int:
        """The newest position `seq` holds (-1: empty)."""
        return int(self.lib.llama_memory_seq_pos_max(self.mem, seq))

    def reaches(self, pos_min: int, n: int) -> bool:
        """Whether a sequence holding positions from `pos_min` on, cut to n tokens, still holds
        what the token at position n attends to. Always, unless the model has sliding-window
        layers: then the window before n must still be there, from position n - n_swa + 1 on
        (llama.cpp masks a key n_swa or more positions back)."""
        return not self.n_swa or n <= 0 or 0 <= pos_min <= max(0, n - self.n_swa + 1)

    def can_continue_at(self, seq: int, n: int) -> bool:
        """`reaches` for sequence `seq` as it is now."""
        return self.reaches(self.pos_min(seq), n)

    def window_min(self, seq: int) -> int:
        """The oldest position a windowed state of `seq` (state_bytes()) holds: llama.cpp leaves
        out of it what the sliding window no longer shows its last position."""
        return max(self.pos_min(seq), self.pos_max(seq) - self.n_swa + 1) if self.n_swa else self.pos_min(seq)

    def state_size(self, seq: int, whole: bool = False) -> int:
        lib = self.lib
        return int(lib.llama_state_get_size(self.ctx) if whole else lib.llama_state_seq_get_size(self.ctx, seq))

    def clear(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def state_bytes(self, seq: int, whole: bool = False) -> bytearray:
        """Sequence `seq`'s KV state as llama.cpp serialises it, written straight into the buffer
        that keeps it (one copy: the buffer's pages are the kernel's zero pages until llama.cpp
        writes them). Windowed (llama_state_seq_get_data): sliding-window layers only as far as
        the last position sees, so it can be continued only from its end. Whole
        (llama_state_get_data, a one-sequence context: `seq` is its only one): every position
        they still hold (down to pos_min()), so it can be cut back as far as the live sequence
        could."""
        size = self.state_size(seq, whole)
        buf = bytearray(size)
        view = (ctypes.c_uint8 * size).from_buffer(buf)
        lib = self.lib
        got = int(lib.llama_state_get_data(self.ctx, view, size) if whole
                  else lib.llama_state_seq_get_data(self.ctx, view, size, seq))
        del view  # the buffer is exported while a view lives: released before any resize
        if got == 0 and size:
            raise DecodeError("llama.cpp returned no state")
        if got != size:
            del buf[got:]
        return buf

    def set_state(self, seq: int, data: bytes | bytearray, whole: bool = False) -> bool:
        """Replace sequence `seq`'s KV with a saved state (made by state_bytes with the same
        `whole`; a windowed one into any sequence, a whole one into the one it was taken from);
        False (and an empty sequence) where llama.cpp refuses it (other model, context or cache
        layout). A bytearray is read in place; bytes are copied once (ctypes needs a writable
        buffer)."""
        self.clear(seq)
        if isinstance(data, bytearray):
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        lib = self.lib
        got = int(lib.llama_state_set_data(self.ctx, buf, len(data)) if whole
                  else lib.llama_state_seq_set_data(self.ctx, buf, len(data), seq))
        if got == 0:
            self.clear(seq)
            return False
        return True

    def close(self) -> None:
        """The batch, the context and the model freed now (once)."""
        if hasattr(self, "_free"):
            self._free()
        else:  # the context could not be made: only the model is there
            _free(self.lib, self.model, self.ctx, None)
        self._batch = self.ctx = self.model = None


def _context_params(lib: Any, s: ContextSettings) -> Any:
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = s.n_ctx, s.n_batch, min(s.n_ubatch, s.n_batch)
    cp.n_threads, cp.n_threads_batch = s.n_threads, s.n_threads_batch
    cp.flash_attn_type = FLASH_ATTN[s.flash_attn]
    cp.swa_full = s.swa_full
    cp.no_perf = False
    cp.n_seq_max = max(1, s.n_seq) + 1  # the slots and a spare one (Native.spare)
    cp.kv_unified = True  # one pool of n_ctx cells for every slot
    cp.type_k, cp.type_v = GGML_TYPES[s.type_k][0], GGML_TYPES[s.type_v][0]  # KV types (issue 55)
    return cp


def _free(lib: Any, model: Any, ctx: Any, batch: Any) -> None:
    if batch is not None:
        lib.llama_batch_free(batch)
    if ctx:
        lib.llama_free(ctx)
    if model:
        lib.llama_model_free(model)
