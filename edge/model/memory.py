"""What one llama.cpp model needs in memory, from its GGUF header and tensor table alone: the
weights (CPU-resident and offloaded), the KV cache of n_ctx tokens in its types, the compute
buffers, the prompt cache's bound, and an embeddings context where the model has one. The
reload's memory guard (edge.lifecycle.memguard) adds them up.

Unified memory (a Jetson): llama.cpp copies offloaded weights into GPU buffers, which are DRAM
too, so they count in full whether or not the file is mapped already (only the CPU-resident
tensors share the mapped pages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from edge.config import EmbeddingsConfig, ModelConfig
from edge.device.memory import MIB, read_memory
from edge.model.gguf import GGUFInfo, offload_split
from edge.model.kvtypes import bytes_per_element, flash_attn_forced

__all__ = ["AUTO_CTX_MAX", "CONTEXT_OVERHEAD", "ContextPlan", "adapters_need", "context_plan", "embeddings_need",
           "kv_bytes", "model_need", "prompt_cache_bytes"]

CONTEXT_OVERHEAD = 16 * MIB  # per llama.cpp context: graph metadata, scratch, tokenizer tables
AUTO_CTX_MAX = 32768  # tokens: an unset n_ctx is the model's trained context, at most this
AUTO_CTX_MIN = 512  # tokens: an unset n_ctx is at least this, whatever the memory (edge doctor warns)
KV_SHARE = 4  # an unset n_ctx's KV cache takes at most 1/KV_SHARE of what the weights leave
SLOT_SHARE = 512  # tokens each slot can count on when every one is busy, for an unset `parallel`
AUTO_SLOTS = (4, 8)  # an unset `parallel`: at least 4 (llama-server's `-np auto`), at most 8


def _int(meta: dict[str, Any], key: str, default: int) -> int:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


@dataclass(frozen=True)
class ContextPlan:
    """A model's context and slots as a start makes them, and why (edge doctor, the start report)."""

    n_ctx: int
    parallel: int
    n_ctx_why: str
    parallel_why: str

    def as_dict(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "parallel": self.parallel, "n_ctx_why": self.n_ctx_why,
                "parallel_why": self.parallel_why}


def context_plan(m: ModelConfig, info: GGUFInfo | None, ceiling: int | None = None) -> ContextPlan:
    """`n_ctx` and `parallel` as set, or, unset, sized for the model and the device (as
    llama-server's `-c 0` takes the model's context and `-np auto` picks slots): the context the
    model was trained for, at most AUTO_CTX_MAX, and at most what a KV cache of 1/KV_SHARE of
    the memory the weights leave holds (`ceiling`: the most the service may hold, MemTotal or
    its cgroup's limit; read here when None); one slot per SLOT_SHARE tokens of it, 4 to 8
    (AUTO_SLOTS). The slots share the context's cells (unified KV) and take them as tokens
    are decoded (edge.model.admission), so one request alone may still use the whole context."""
    if m.n_ctx is not None:
        n_ctx, n_why = m.n_ctx, "n_ctx"
    else:
        n_ctx, n_why = _auto_ctx(m, info, ceiling)
    if m.parallel is not None:
        return ContextPlan(n_ctx, m.parallel, n_why, "parallel")
    low, high = AUTO_SLOTS
    parallel = max(low, min(high, n_ctx // SLOT_SHARE))
    return ContextPlan(n_ctx, parallel, n_why, f"automatic: one per {SLOT_SHARE} tokens of n_ctx, {low} to {high}")


def _auto_ctx(m: ModelConfig, info: GGUFInfo | None, ceiling: int | None) -> tuple[int, str]:
    trained = info.context_length if info is not None else None
    n_ctx = min(trained or AUTO_CTX_MAX, AUTO_CTX_MAX)
    why = (f"automatic: the model's trained context ({trained})" if trained and trained <= AUTO_CTX_MAX
           else f"automatic: {AUTO_CTX_MAX}" + (f" of the model's trained {trained}" if trained else
                                                 " (the model does not say its trained context)"))
    if info is None:
        return n_ctx, why
    total = read_memory().ceiling if ceiling is None else ceiling
    per_token = kv_bytes(m, info, 1)
    if total and per_token:
        fits = max(0, total - info.data_bytes) // KV_SHARE // per_token // 256 * 256
        if fits < n_ctx:
            n_ctx = max(AUTO_CTX_MIN, fits)
            why = (f"automatic: what a KV cache of 1/{KV_SHARE} of the memory beside the weights holds "
                   f"({total // MIB} MiB in all, {per_token // 1024} KiB per token; trained for {trained})")
    return n_ctx, why


def kv_bytes(m: ModelConfig, info: GGUFInfo, n_ctx: int, types: tuple[str, str] | None = None) -> int:
    """The KV cache of n_ctx tokens in the model's type_k/type_v (`types`: others): every layer's K
    and V, from the GGUF header (an upper bound for sliding-window models, whose window layers
    keep less). One pool for every slot (unified KV): the same whatever `parallel` is."""
    meta, arch = info.metadata, info.architecture
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    k_len = _int(meta, f"{arch}.attention.key_length", _int(meta, f"{arch}.embedding_length", 1) // n_head or 1)
    v_len = _int(meta, f"{arch}.attention.value_length", k_len)
    # KV types (issue 55): each element at its type's size (q8_0: 34 bytes a block of 32)
    type_k, type_v = types or (m.type_k, m.type_v)
    per_head = k_len * bytes_per_element(type_k) + v_len * bytes_per_element(type_v)
    return int(_int(meta, f"{arch}.block_count", 1) * n_ctx
               * _int(meta, f"{arch}.attention.head_count_kv", n_head) * per_head)


def model_need(m: ModelConfig, info: GGUFInfo, shared_file: bool, unified: bool = False) -> dict[str, int]:
    """One model: its weights (CPU-resident ones 0 when the same file is mapped already), the KV
    cache of its n_ctx tokens (context_plan) in its KV types, and the compute buffers llama.cpp
    sizes by n_batch (an upper estimate). Offloaded weights are copies (llama.cpp's GPU buffers): on unified memory they are
    DRAM whether or not the file is mapped."""
    meta, arch = info.metadata, info.architecture
    n_layer = _int(meta, f"{arch}.block_count", 1)
    n_embd = _int(meta, f"{arch}.embedding_length", 1)
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    n_vocab = _int(meta, "n_vocab", 32000)
    n_ctx = context_plan(m, info).n_ctx
    n_batch = min(m.n_batch, n_ctx)
    kv = kv_bytes(m, info, n_ctx)
    # logits of one batch, the attention scores of one batch against the context (with flash
    # attention surely on, only its f16 mask: issue 55, measured), activations
    scores = n_ctx // 2 if m.flash_attn is True or flash_attn_forced(m) else n_head * n_ctx
    compute = 4 * n_batch * (n_vocab + scores + 4 * n_embd) + CONTEXT_OVERHEAD
    if m.n_gpu_layers != 0 and info.tensors:
        split = offload_split(info, m.n_gpu_layers, None)
        # a locked mapping pins its whole range, offloaded tensors stored before the last CPU one too
        cpu_weights = split.locked if m.use_mlock and m.use_mmap else split.cpu
        gpu_weights = split.gpu
    else:
        cpu_weights, gpu_weights = info.data_bytes, 0
    weights = (0 if shared_file and m.use_mmap else cpu_weights) + (gpu_weights if unified else 0)
    offloaded = 1.0 if m.n_gpu_layers < 0 else min(1.0, m.n_gpu_layers / n_layer)
    gpu = gpu_weights + int(offloaded * kv) + (compute if offloaded else 0)
    # the prompt cache fills to its bound with traffic whether or not prefixes are declared (they
    # are restored into it before the switch): the process holds it (0 only where it is off)
    cache = prompt_cache_bytes(m, kv)
    # the embeddings context beside it on the same weights (issue 55: edge.model.embed)
    embed = embeddings_need(m, info)
    gpu += int(offloaded * embed)
    lora = adapters_need(m)  # llama.cpp reads each adapter's tensors into a buffer of their size
    return {"model": weights, "kv_cache": kv, "compute": compute, "prompt_cache": cache, "embeddings": embed,
            "adapters": lora, "gpu": gpu, "dram": weights + kv + compute + cache + embed + lora}


def adapters_need(m: ModelConfig) -> int:
    """The LoRA adapters' files (edge.model.adapters), whole: their tensors are most of them."""
    total = 0
    for a in m.adapters:
        try:
            total += os.path.getsize(a.path)
        except OSError:
            pass  # a missing file is the load's refusal to make, naming it
    return total


def embeddings_need(m: ModelConfig, info: GGUFInfo) -> int:
    """The embeddings context (edge.model.embed; issue 55): an f16 KV cache of n_batch cells, and
    the logits of every token of a batch twice: llama.cpp computes a causal model's output layer
    for every token there (its compute buffer) and copies them out (its output buffer). Measured
    on Gemma 3 270M: 1,037 MiB at n_batch 512, 523 MiB at 256."""
    e = m.embeddings
    if not isinstance(e, EmbeddingsConfig):
        return 0
    meta, arch = info.metadata, info.architecture
    n_vocab, n_embd = _int(meta, "n_vocab", 32000), _int(meta, f"{arch}.embedding_length", 1)
    n_head = 1 if e.flash_attn else _int(meta, f"{arch}.attention.head_count", 1)
    kv = kv_bytes(m, info, e.n_batch, ("f16", "f16"))
    return kv + 4 * e.n_batch * (2 * n_vocab + n_head * e.n_batch + 5 * n_embd) + CONTEXT_OVERHEAD


def prompt_cache_bytes(m: ModelConfig, kv_bytes: int, total_ram: int | None = None) -> int:
    """The prompt cache's bound (edge.model.promptcache): `prompt_cache_mb`, or when unset the KV of
    two full contexts (`kv_bytes`: one context's), at most 1/16 of RAM (of the cgroup's limit
    where that is smaller: what the service may ever hold)."""
    if m.prompt_cache_mb is not None:
        return m.prompt_cache_mb << 20
    total = read_memory().ceiling if total_ram is None else total_ram
    return min(2 * kv_bytes, total // 16) if total else 2 * kv_bytes
