"""What one llama.cpp model needs in memory, from its GGUF header and tensor table alone: the
weights (CPU-resident and offloaded), the f16 KV cache of n_ctx tokens, the compute buffers, and
the prompt cache's bound. The reload's memory guard (edge.lifecycle.memguard) adds them up.

Unified memory (a Jetson): llama.cpp copies offloaded weights into GPU buffers, which are DRAM
too, so they count in full whether or not the file is mapped already (only the CPU-resident
tensors share the mapped pages).
"""

from __future__ import annotations

from typing import Any

from edge.config import ModelConfig
from edge.device.memory import MIB, read_memory
from edge.model.gguf import GGUFInfo, offload_split

__all__ = ["CONTEXT_OVERHEAD", "kv_bytes", "model_need", "parallel_for", "prompt_cache_bytes"]

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


def kv_bytes(m: ModelConfig, info: GGUFInfo) -> int:
    """The f16 KV cache of n_ctx tokens: every layer's K and V, from the GGUF header. One pool for
    every slot (unified KV): the same whatever `parallel` is."""
    meta, arch = info.metadata, info.architecture
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    k_len = _int(meta, f"{arch}.attention.key_length", _int(meta, f"{arch}.embedding_length", 1) // n_head or 1)
    v_len = _int(meta, f"{arch}.attention.value_length", k_len)
    return (_int(meta, f"{arch}.block_count", 1) * m.n_ctx
            * _int(meta, f"{arch}.attention.head_count_kv", n_head) * (k_len + v_len) * 2)


def model_need(m: ModelConfig, info: GGUFInfo, shared_file: bool, unified: bool = False) -> dict[str, int]:
    """One model: its weights (CPU-resident ones 0 when the same file is mapped already), the f16
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
    # logits of one batch, the attention scores of one batch against the context, activations
    compute = 4 * n_batch * (n_vocab + n_head * n_ctx + 4 * n_embd) + CONTEXT_OVERHEAD
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
    return {"model": weights, "kv_cache": kv, "compute": compute, "prompt_cache": cache, "gpu": gpu,
            "dram": weights + kv + compute + cache}


def prompt_cache_bytes(m: ModelConfig, kv_bytes: int, total_ram: int | None = None) -> int:
    """The prompt cache's bound (edge.model.promptcache): `prompt_cache_mb`, or when unset the KV of
    two full contexts (`kv_bytes`: one context's), at most 1/16 of RAM (of the cgroup's limit
    where that is smaller: what the service may ever hold)."""
    if m.prompt_cache_mb is not None:
        return m.prompt_cache_mb << 20
    total = read_memory().ceiling if total_ram is None else total_ram
    return min(2 * kv_bytes, total // 16) if total else 2 * kv_bytes
