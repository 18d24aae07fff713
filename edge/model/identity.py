"""What a llama.cpp model's saved artefacts are keyed by: the model file, the llama.cpp that loaded
it, the context settings that change what it computes, and the device. The warm-up plan's key
(edge.lifecycle.warmup.plan) and a saved KV state's key (edge.model.prefixstore) are made of these,
and a stored key that differs is reported field by field (`key_differences`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.device.identity import DeviceInfo
    from edge.model.llm import GGUFModel

__all__ = ["context_identity", "device_identity", "key_differences", "kv_cache_types", "model_identity"]

# Device fields that identify hardware and software; the *_source fields say how they were found.
_DEVICE_FIELDS = ("cpu_arch", "jetson_model", "soc", "l4t_release", "sm", "cuda", "tensorrt",
                  "onnxruntime", "gpu_name", "cuda_driver", "platform")


def device_identity(device: DeviceInfo) -> dict[str, Any]:
    d = device.as_dict()
    return {k: d.get(k) for k in _DEVICE_FIELDS}


def model_identity(model: GGUFModel) -> dict[str, Any]:
    """The model file in a key: its configured sha256, else its path, size and mtime."""
    if model.cfg.sha256:
        return {"model_id": "sha256", "model_sha256": model.cfg.sha256.lower()}
    st = os.stat(model.info.path)
    return {"model_id": "path+size+mtime", "model_path": os.path.realpath(model.info.path),
            "model_size": st.st_size, "model_mtime_ns": st.st_mtime_ns}


def context_identity(model: GGUFModel, build: str | None) -> dict[str, Any]:
    """The model file, the llama.cpp that loaded it (version, CPU features, CPU/CUDA `build`) and
    every context setting that changes what it computes: what the warm-up plan's key and a saved
    KV state's key share. Reads the loaded context's settings (plain fields: any thread)."""
    import llama_cpp

    from edge.model.bindings import complete

    complete()  # `__version__` is the package's __init__'s (a start imports the bindings first)

    p = model.native.params
    return {**model_identity(model), "llama_cpp_python": getattr(llama_cpp, "__version__", None),
            "llama_system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
            "backend": build, "n_ctx": model.n_ctx, "n_batch": int(p.n_batch), "n_ubatch": int(p.n_ubatch),
            "n_gpu_layers": model.cfg.n_gpu_layers, "flash_attn": model.cfg.flash_attn_mode,
            "swa_full": bool(p.swa_full),
            # only when off: keys made before the field existed (extra buffer types on) still match
            **({} if model.native.settings.use_extra_bufts else {"use_extra_bufts": False}),
            # only with several slots: a state of a one-sequence context may be of all of it
            **({"n_seq_max": model.native.n_seq} if model.native.n_seq > 1 else {}),
            **kv_cache_types(p)}


def kv_cache_types(p: Any) -> dict[str, str]:
    """The KV cache's types (llama-server's -ctk/-ctv names) where either is not f16: keys made
    before they could be set (f16) still match, and a state of one type is never restored into
    a cache of another (a warm-up plan measured on one is not taken for the other either)."""
    from edge.model.kvtypes import type_name

    k, v = type_name(int(p.type_k)), type_name(int(p.type_v))
    return {} if (k, v) == ("f16", "f16") else {"cache_type_k": k, "cache_type_v": v}


def key_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """`n_ctx 256 → 512`, one per field that differs (nested device fields by their own name)."""
    out = []
    for k in sorted(set(stored) | set(wanted)):
        a, b = stored.get(k), wanted.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{d}" for d in key_differences(a, b)]
        elif a != b:
            out.append(f"{k} {a} → {b}")
    return out
