"""Can llama.cpp offload to the GPU here, and if not, why? A model with n_gpu_layers ≠ 0 on a
llama.cpp without a GPU silently runs every layer on the CPU; edge refuses to start instead,
saying which of two causes it is, because their fixes differ:

- a CPU-only build (no CUDA backend compiled in): rebuild llama-cpp-python with CUDA;
- a CUDA build whose device did not start: ggml-cuda registers its backend with no device when
  CUDA fails to initialize (ggml_cuda_init: "failed to initialize CUDA"), so
  `llama_supports_gpu_offload()` — "is a GPU device registered now" — is false there too. The
  driver's own reason (cuInit's error, or a missing libcuda) and the device-node hint are asked
  of the CUDA driver API (edge.device.identity.probe_gpu).

Whether CUDA is compiled in is read from the shared libraries the package ships, without
importing llama_cpp: `libggml-cuda*` beside libllama (the default, GGML_CUDA with shared ggml),
or the CUDA backend's registration symbol inside a statically linked library.
"""

from __future__ import annotations

import importlib.util
import sys
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.errors import GpuOffloadUnavailable

__all__ = ["CUDA_BUILD_FIX", "llama_build", "llama_lib_dir", "llama_package_dir", "offload_problem",
           "output_layer_first", "require_gpu_offload"]

CUDA_BUILD_FIX = ('CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87" '
                  "pip install --force-reinstall --no-cache-dir llama-cpp-python "
                  "(87 = Orin; the cache would hand back the CPU-only wheel), or set n_gpu_layers = 0")
CUDA_SYMBOL = b"ggml_backend_cuda_reg\0"  # the CUDA backend's registration function


def _gpu_error() -> str:
    from edge.device.identity import probe_gpu

    probe = probe_gpu()
    return probe.error or "the driver reports a GPU now, but llama.cpp registered none when it started"


def offload_problem(build: str | None, model: str, n_gpu_layers: int,
                    gpu_error: Callable[[], str] = _gpu_error) -> str:
    """Why a model asking for `n_gpu_layers` cannot be offloaded with this `build` of llama.cpp."""
    if build == "cuda":
        return (f"model {model!r} asks for n_gpu_layers = {n_gpu_layers}; llama.cpp is a CUDA build, but "
                f"its CUDA device did not start: {gpu_error()}")
    return (f"model {model!r} asks for n_gpu_layers = {n_gpu_layers}, but this llama-cpp-python is a "
            f"CPU-only build (no CUDA backend compiled in) and would run every layer on the CPU. Rebuild it "
            f"with CUDA: {CUDA_BUILD_FIX}")


def require_gpu_offload(llama_cpp: Any, model: str, n_gpu_layers: int,
                        build: Callable[[], str | None] | None = None,
                        gpu_error: Callable[[], str] = _gpu_error) -> None:
    """Call before loading a model with `n_gpu_layers`; `llama_cpp` is the imported module,
    `build`/`gpu_error` what the installed libraries and the driver say (tests pass doubles)."""
    if n_gpu_layers == 0:
        return
    supports = getattr(llama_cpp, "llama_supports_gpu_offload", None)
    if supports is not None and bool(supports()):
        return
    raise GpuOffloadUnavailable(offload_problem((build or llama_build)(), model, n_gpu_layers, gpu_error))


def _has_cuda_symbol(lib: Path) -> bool:
    try:
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return m.find(CUDA_SYMBOL) >= 0
    except (OSError, ValueError):
        return False


# ggml-org/llama.cpp#18148 (merged 2025-12-17) moved the output layer to the front of the
# n_gpu_layers count. libllama carried version 0.0.<build number> then: builds at or below
# OLD_RULE_UP_TO are older than it, builds from NEW_RULE_FROM newer; between them, unknown.
OLD_RULE_UP_TO, NEW_RULE_FROM = 7400, 7500


def output_layer_first(package_dir: str | Path | None = None) -> bool | None:
    """Which n_gpu_layers rule the installed llama.cpp has (edge.model.gguf.offload_split), from its
    libllama's version: True (output layer first), False (blocks first), None (not known)."""
    folder = Path(package_dir) if package_dir else llama_package_dir()
    versions = [] if folder is None else [p.name.split(".so.", 1)[1] for p in folder.rglob("libllama.so.*.*")]
    for v in versions:
        parts = [int(x) for x in v.split(".") if x.isdigit()]
        if len(parts) == 3 and parts[:2] == [0, 0]:
            build = parts[2]
            return False if build <= OLD_RULE_UP_TO else True if build >= NEW_RULE_FROM else None
        if len(parts) == 3:
            return True  # the semantic versions that followed the build numbers (0.5.0, ...)
    return None


def llama_package_dir() -> Path | None:
    """The installed llama_cpp package's folder (its libraries are under lib/), found without
    importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def llama_build(package_dir: str | Path | None = None) -> str | None:
    """"cuda", "cpu", or None (llama_cpp not installed), without importing llama_cpp."""
    package_dir = package_dir or llama_package_dir()
    if package_dir is None:
        return None
    libs = [p for p in Path(package_dir).rglob("*.so*") if not p.is_symlink()]
    if any(p.name.startswith("libggml-cuda") for p in libs):
        return "cuda"
    if any(p.name.startswith(("libllama", "libggml")) and _has_cuda_symbol(p) for p in libs):
        return "cuda"  # ggml linked statically into libllama
    return "cpu" if libs else None


def llama_lib_dir() -> Path | None:
    """llama_cpp's bundled libraries (the loaded package's, else the installed one's), found
    without importing it (edge may serve engines only)."""
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None and getattr(loaded, "__file__", None):
        return Path(loaded.__file__).parent / "lib"
    package = llama_package_dir()
    return package / "lib" if package else None
