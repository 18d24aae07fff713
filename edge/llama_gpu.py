"""Is llama-cpp-python built with CUDA? A CPU-only build silently ignores n_gpu_layers; edge
refuses to start instead, and says how to rebuild.

Two questions, two answers: at load time the loaded library's own
`llama_supports_gpu_offload()`; for `edge doctor` (which imports no llama_cpp) the shared
libraries the package ships (`libggml-cuda*` sits beside libllama when built with GGML_CUDA).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from edge.errors import EX_CONFIG, EdgeError

__all__ = ["CUDA_BUILD_FIX", "GpuOffloadUnavailable", "llama_build", "require_gpu_offload"]

CUDA_BUILD_FIX = ('CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87" '
                  "pip install --force-reinstall --no-cache-dir llama-cpp-python "
                  "(87 = Orin; the cache would hand back the CPU-only wheel), or set n_gpu_layers = 0")


class GpuOffloadUnavailable(EdgeError):
    """n_gpu_layers > 0, and the installed llama.cpp cannot offload (a CPU-only build)."""

    exit_code = EX_CONFIG  # a restart cannot fix it: the unit stops instead of looping

    def __init__(self, model: str, n_gpu_layers: int) -> None:
        super().__init__(f"model {model!r} asks for n_gpu_layers = {n_gpu_layers}, but this "
                         f"llama-cpp-python is a CPU-only build (llama_supports_gpu_offload() is "
                         f"false) and would run every layer on the CPU. Rebuild it with CUDA: {CUDA_BUILD_FIX}")


def require_gpu_offload(llama_cpp: Any, model: str, n_gpu_layers: int) -> None:
    """Call before loading a model with `n_gpu_layers`; `llama_cpp` is the imported module."""
    if n_gpu_layers == 0:
        return
    supports = getattr(llama_cpp, "llama_supports_gpu_offload", None)
    if supports is None or not bool(supports()):
        raise GpuOffloadUnavailable(model, n_gpu_layers)


def llama_build(package_dir: str | Path | None = None) -> str | None:
    """"cuda", "cpu", or None (llama_cpp not installed), without importing llama_cpp."""
    if package_dir is None:
        try:
            spec = importlib.util.find_spec("llama_cpp")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return None
        package_dir = next(iter(spec.submodule_search_locations))
    libs = [p.name for p in Path(package_dir).rglob("*.so*")]
    if any(n.startswith("libggml-cuda") for n in libs):
        return "cuda"
    return "cpu" if libs else None
