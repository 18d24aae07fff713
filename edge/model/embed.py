"""Embeddings from a loaded model: a second llama.cpp context on the same weights, made with
`embeddings` on and the configured pooling ([models.embeddings]; llama-server's --embeddings
--pooling), one decode per batch of whole inputs.

One mapping of the weights serves both contexts: llama.cpp lets several contexts share one
`llama_model`, and on an 8 GB device with offloaded layers a second load would be a second copy
of them. Both contexts are driven from the model's one worker thread (edge.serve.worker), never at
once: whether two contexts of one model may decode concurrently is not something llama.cpp
promises, and on a device's few cores they would only take turns at its threads anyway.

Pooling reduces an input's token embeddings to one vector inside llama.cpp's graph, per
sequence and per physical batch, so an input is never split across batches: the context's batch
is `n_batch` tokens (n_ctx = n_batch = n_ubatch) and an input longer than that is refused before
it reaches the model. Inputs are packed into a batch in order as sequences of their own (each from
position 0, its cells cleared after), as llama.cpp's own tools pack them, so the vectors are
theirs; an input's vector in a batch and alone part by at most ~1e-4 in cosine with flash
attention off (the default, `flash_attn`: llama.cpp's matmul kernels differ with a batch's row
count), where llama.cpp's CPU flash attention takes another path for larger batches (0.9985 on
Gemma 3 270M).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from edge.config import EmbeddingsConfig, ModelConfig
from edge.errors import ConfigError, RequestError

if TYPE_CHECKING:
    import numpy as np

    from edge.model.gguf import GGUFInfo
    from edge.model.native import Native

__all__ = ["EmbedContext", "MAX_SEQ", "check_embeddings", "finish", "pack", "pooling_for"]

POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}  # llama.h's llama_pooling_type
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context can tell apart


def pooling_for(cfg: EmbeddingsConfig, info: GGUFInfo) -> tuple[str, str]:
    """(pooling, why): the configured one, else the GGUF's own ({arch}.pooling_type, as a
    dedicated embedding model declares it), else mean."""
    if cfg.pooling:
        return cfg.pooling, "configured"
    declared = info.metadata.get(f"{info.architecture}.pooling_type")
    name = next((n for n, t in POOLING_TYPES.items() if t == declared), None)
    if name:
        return name, f"the model's own ({info.architecture}.pooling_type)"
    return "mean", "default: the model declares none"


def check_embeddings(m: ModelConfig, info: GGUFInfo, source: str, where: str) -> None:
    """ConfigError (exit 78) for Matryoshka sizes the model's vectors do not have."""
    e, n_embd = m.embeddings, info.metadata.get(f"{info.architecture}.embedding_length")
    if not isinstance(e, EmbeddingsConfig) or not isinstance(n_embd, int):
        return
    for i, d in enumerate(e.dimensions):
        if d > n_embd:
            raise ConfigError(source, f"{where}.embeddings.dimensions[{i}]", f"{d} is more than the "
                              f"{n_embd} values of this model's vectors ({info.architecture}.embedding_length)")


def pack(lengths: Sequence[int], n_batch: int, n_seq: int) -> int:
    """How many of the waiting inputs (their token counts, oldest first) the next batch takes: in
    order, while they fit (longer inputs were refused before they waited). The order is
    llama.cpp's own tools' (llama-cpp-python's `Llama.embed`, llama-server's slots): the same
    inputs make the same batches, and so the same vectors (llama.cpp's kernels differ with a
    batch's row count: an input's vector alone and in a batch part by up to 1e-4 in cosine)."""
    taken, room = 0, n_batch
    for n in lengths[:n_seq]:
        if n > room:
            break
        taken, room = taken + 1, room - n
    return max(taken, 1)


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Rows cut to `dimensions` (a Matryoshka size the model was trained for) and scaled to unit
    length (L2, as llama-server's default embd_normalize 2 and OpenAI do); a zero row stays zero."""
    import numpy as np

    out = vectors[:, :dimensions] if dimensions else vectors
    if normalize:
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        out = (out / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return out


class EmbedContext:
    """A llama.cpp context with embeddings on, sharing `native`'s model. Not thread-safe: use it
    from the model's worker thread, between the generation context's steps."""

    def __init__(self, native: Native, cfg: EmbeddingsConfig, info: GGUFInfo) -> None:
        lib = self.lib = native.lib
        self.cfg = cfg
        self.pooling, self.pooling_why = pooling_for(cfg, info)
        self.n_batch = cfg.n_batch
        self.n_seq = min(cfg.n_batch, MAX_SEQ)
        s = native.settings
        cp = lib.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = cfg.n_batch  # an input is pooled within one physical batch
        cp.n_seq_max, cp.kv_unified = self.n_seq, True
        cp.n_threads, cp.n_threads_batch = s.n_threads, s.n_threads_batch
        cp.embeddings, cp.pooling_type = True, POOLING_TYPES[self.pooling]
        cp.flash_attn_type = 1 if cfg.flash_attn else 0
        cp.swa_full = True  # n_batch cells: every position a batch holds
        self.ctx = lib.llama_init_from_model(native.model, cp)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create an embeddings context of {cfg.n_batch} tokens "
                             f"with {self.pooling} pooling")
        self.mem = lib.llama_get_memory(self.ctx)  # none for a non-causal model (llama.cpp encodes)
        self.n_embd = int(lib.llama_model_n_embd_out(native.model))
        self.n_vocab = native.n_vocab
        self._batch = lib.llama_batch_init(cfg.n_batch, 0, 1)
        b = self._batch
        for i in range(cfg.n_batch):  # one sequence per row, every row an output (pooling needs all)
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
        ctypes.memset(b.logits, 1, cfg.n_batch)
        self._rows = [0] * cfg.n_batch
        # freed when dropped without close(); holds `native` so its model outlives this context
        self._free = weakref.finalize(self, _free, lib, self.ctx, self._batch, native)
        self.batches = 0  # decodes made, and the inputs they held (/metrics)
        self.inputs = 0

    def describe(self) -> dict[str, Any]:
        """What the start report, /v1/models and `edge status` say of it."""
        return {"pooling": self.pooling, "pooling_from": self.pooling_why, "n_batch": self.n_batch,
                "dimensions": self.n_embd, "normalize": self.cfg.normalize, "flash_attn": self.cfg.flash_attn,
                "matryoshka": list(self.cfg.dimensions)}

    def check(self, tokens: Sequence[int], index: int) -> None:
        """A 400 naming `input[index]` for an input no batch can hold, or one with no token."""
        if not tokens:
            raise RequestError(f"input[{index}] has no token to embed", param=f"input[{index}]")
        if len(tokens) > self.n_batch:
            raise RequestError(f"input[{index}] is {len(tokens)} tokens: more than the {self.n_batch} an "
                               "embeddings batch holds (models[].embeddings.n_batch)",
                               param=f"input[{index}]", code="context_length_exceeded")

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One decode of `inputs` (each a sequence of its own, together at most n_batch tokens and
        n_seq inputs): their pooled vectors as rows, not normalized."""
        import numpy as np

        n = sum(len(t) for t in inputs)
        if n > self.n_batch or len(inputs) > self.n_seq:
            raise ValueError(f"{len(inputs)} inputs of {n} tokens do not fit one batch ({self.n_batch} tokens)")
        lib, b, i32 = self.lib, self._batch, ctypes.c_int32
        tokens = [t for seq in inputs for t in seq]
        ctypes.memmove(b.token, (i32 * n)(*tokens), 4 * n)
        ctypes.memmove(b.pos, (i32 * n)(*[p for seq in inputs for p in range(len(seq))]), 4 * n)
        row, rows, seq_id = 0, self._rows, b.seq_id
        for s, seq in enumerate(inputs):
            for _ in seq:
                if rows[row] != s:
                    rows[row] = seq_id[row][0] = s
                row += 1
        b.n_tokens = n
        if self.mem:
            lib.llama_memory_clear(self.mem, True)
        rc = lib.llama_decode(self.ctx, b)
        if rc:
            raise RuntimeError(f"llama_decode of an embeddings batch of {n} tokens returned {rc}")
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        for s in range(len(inputs)):
            ptr = lib.llama_get_embeddings_seq(self.ctx, s)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {s}")
            out[s] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
        self.batches += 1
        self.inputs += len(inputs)
        return out

    def close(self) -> None:
        """The context and its batch freed now (before the model's: edge.model.llm closes them in order)."""
        self._free()
        self.ctx = self._batch = None


def _free(lib: Any, ctx: Any, batch: Any, native: Native) -> None:
    del native  # held until here: the model is freed after this context, never before
    if batch is not None:
        lib.llama_batch_free(batch)
    if ctx:
        lib.llama_free(ctx)
