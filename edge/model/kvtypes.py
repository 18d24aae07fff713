"""The KV cache's element types (`type_k`/`type_v`): what llama.cpp calls each one, what an element
costs, and what a model's GGUF header must allow before llama.cpp is asked for such a cache.

llama.cpp (the version pinned in pyproject) creates a context with a quantized cache only where
every layer's head size is a multiple of the type's block (32 elements), refuses a quantized V
cache without flash attention (and turns flash attention on for it when left to "auto"), and
refuses K and V of different types for MLA models (DeepSeek 2/3's compressed KV). edge checks the
same before the load, so such a config is an exit-78 error naming the field, not a context that
llama.cpp declines with a line in its log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edge.config import QUANTIZED_KV_TYPES, ModelConfig
from edge.errors import ConfigError

if TYPE_CHECKING:
    from edge.model.gguf import GGUFInfo

__all__ = ["GGML_TYPES", "bytes_per_element", "check_kv_types", "flash_attn_forced", "kv_type_problem",
           "kv_types_label", "type_name"]

# name -> (ggml_type in ggml.h, elements per block, bytes per block)
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (0, 1, 4), "f16": (1, 1, 2), "bf16": (30, 1, 2),
    "q8_0": (8, 32, 34), "q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "iq4_nl": (20, 32, 18),
    "q5_0": (6, 32, 22), "q5_1": (7, 32, 24),
}


def bytes_per_element(name: str) -> float:
    _, block, size = GGML_TYPES[name]
    return size / block


def type_name(ggml_type: int) -> str:
    """The config's name of a ggml type id (a loaded context's `type_k`), or `ggml_type_N`."""
    return next((n for n, (t, _, _) in GGML_TYPES.items() if t == ggml_type), f"ggml_type_{ggml_type}")


def flash_attn_forced(m: ModelConfig) -> bool:
    """A quantized V cache: llama.cpp computes attention with flash attention whatever "auto"
    would have chosen (the config refuses flash_attn = false with it)."""
    return m.type_v in QUANTIZED_KV_TYPES


def kv_types_label(m: ModelConfig) -> str:
    return m.type_k if m.type_k == m.type_v else f"K {m.type_k}, V {m.type_v}"


def _int(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _head_sizes(info: GGUFInfo) -> dict[str, int]:
    """The K and V head sizes the header gives (key_length / value_length, else n_embd / n_head)."""
    meta, arch = info.metadata, info.architecture
    n_embd, n_head = _int(meta, f"{arch}.embedding_length"), _int(meta, f"{arch}.attention.head_count")
    k = _int(meta, f"{arch}.attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    v = _int(meta, f"{arch}.attention.value_length") or k
    return {name: size for name, size in (("type_k", k), ("type_v", v)) if size}


def kv_type_problem(m: ModelConfig, info: GGUFInfo) -> tuple[str, str] | None:
    """(field, why) where llama.cpp would refuse this model's KV types; None where it takes them."""
    if m.type_k != m.type_v and _int(info.metadata, f"{info.architecture}.attention.kv_lora_rank"):
        return "type_v", (f"{info.architecture} compresses K and V together (MLA): llama.cpp needs type_k "
                          f"and type_v equal, found {m.type_k} and {m.type_v}")
    for field, size in _head_sizes(info).items():
        name = getattr(m, field)
        _, block, _ = GGML_TYPES[name]
        if size % block:
            return field, (f"{name} stores blocks of {block} elements, and this model's "
                           f"{'K' if field == 'type_k' else 'V'} heads have {size} (not a multiple): "
                           f"llama.cpp refuses such a cache; use f16, or a type whose block divides {size}")
    return None


def check_kv_types(m: ModelConfig, info: GGUFInfo, source: str, where: str) -> None:
    """ConfigError (exit 78) naming `where.type_k`/`type_v` where llama.cpp would refuse them."""
    problem = kv_type_problem(m, info)
    if problem is not None:
        raise ConfigError(source, f"{where}.{problem[0]}", problem[1])
