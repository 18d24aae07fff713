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

from typing import Any

from edge.config import EmbeddingsConfig, ModelConfig
from edge.device.memory import MIB, read_memory
from edge.model.gguf import GGUFInfo, offload_split
from edge.model.kvtypes import bytes_per_element, flash_attn_forced

__all__ = ["CONTEXT_OVERHEAD", "adapters_need", "embeddings_need", "kv_bytes", "model_need", "parallel_for", "prompt_cache_bytes"]

CONTEXT_OVERHEAD = 16 * MIB  # per llama.cpp context: graph metadata, scratch, tokenizer tables


def _int(meta: dict[str, Any], key: str, default: int) -> int:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


def parallel_for(m: ModelConfig, total_ram: int | None = None) -> int:
    """The slots a model decodes at once (edge.model.slots): `parallel`, or when unset 4, and 8
    where the context holds 4,096 tokens or more and RAM is 4 GiB or more. The KV cache is
    unified (the slots share n_ctx cells), so a slot costs memory only for its logits row and
    sampler: what limits them is how much of the context each request can count on."""
    if m.parallel is not None:
        return m.parallel
    total = read_memory().ceiling if total_ram is None else total_ram
    return 8 if m.n_ctx >= 4096 and (not total or total >= 4 << 30) else 4


def kv_bytes(m: ModelConfig, info: GGUFInfo, n_ctx: int | None = None, types: tuple[str, str] | None = None) -> int:
    """The KV cache of n_ctx tokens (`n_ctx`: another context's) in the model's type_k/type_v
    (`types`: others): every layer's K and V, from the GGUF header. One pool for every slot
    (unified KV): the same whatever `parallel` is."""
    meta, arch = info.metadata, info.architecture
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    k_len = _int(meta, f"{arch}.attention.key_length", _int(meta, f"{arch}.embedding_length", 1) // n_head or 1)
    v_len = _int(meta, f"{arch}.attention.value_length", k_len)
    # KV types (issue 55): each element at its type's size (q8_0: 34 bytes a block of 32)
    type_k, type_v = types or (m.type_k, m.type_v)
    per_head = k_len * bytes_per_element(type_k) + v_len * bytes_per_element(type_v)
    return int(_int(meta, f"{arch}.block_count", 1) * (n_ctx or m.n_ctx)
               * _int(meta, f"{arch}.attention.head_count_kv", n_head) * per_head)


def model_need(m: ModelConfig, info: GGUFInfo, shared_file: bool, unified: bool = False) -> dict[str, int]:
    """One model: its weights (CPU-resident ones 0 when the same file is mapped already), the
    KV cache of n_ctx tokens, and the compute buffers llama.cpp sizes by n_batch (an upper
    estimate). Offloaded weights are copies (llama.cpp's GPU buffers): on unified memory they are
    DRAM whether or not the file is mapped."""
    meta, arch = info.metadata, info.architecture
    n_layer = _int(meta, f"{arch}.block_count", 1)
    n_embd = _int(meta, f"{arch}.embedding_length", 1)
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    n_vocab = _int(meta, "n_vocab", 32000)
    n_ctx, n_batch = m.n_ctx, min(m.n_batch, m.n_ctx)
    kv = kv_bytes(m, info)
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
    # declared and learned prefix states are restored into the prompt cache before the switch
    cache = prompt_cache_bytes(m, kv) if m.prefixes or m.learn_prefixes else 0
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
