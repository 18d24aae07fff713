"""What a load imports, and when: the inference backends before the models load (for llama.cpp
only its ctypes bindings: edge.model.bindings), the rest of llama_cpp and the HTTP stack beside
the load. Imported after the config, as everything a load needs."""

from __future__ import annotations

import importlib

from edge.errors import require
from edge.model.bindings import complete, import_bindings

__all__ = ["LAZY_FIRST_REQUEST", "complete_llama_cpp", "import_modules"]

# module -> (extra of edge that brings it, pip package, what needs it); the rest: plain imports
_BACKENDS = {"llama_cpp.llama_cpp": (None, "llama-cpp-python", "loading GGUF models"),
             "onnxruntime": ("ort", "onnxruntime", "serving ONNX Runtime engines")}
_IMPORTERS = {"llama_cpp.llama_cpp": import_bindings}  # the bindings alone, not the package's __init__


# Imported by the first request otherwise (starlette's streams and task groups find anyio's asyncio
# backend by name at their first use): some 20 modules, ~30 ms of the warm-up's floor on the
# project's 2-core VM. Private to anyio, so a version without it is skipped, not an error.
LAZY_FIRST_REQUEST = ["anyio._backends._asyncio"]


def import_modules(names: list[str], optional: list[str] | None = None) -> list[str]:
    """Each module imported (a backend missing: MissingDependency naming its package and extra),
    then the `optional` ones where they exist; the names imported."""
    for name in names:
        if name in _BACKENDS:
            extra, package, purpose = _BACKENDS[name]
            require(name, extra, purpose, package=package, importer=_IMPORTERS.get(name))
        else:
            importlib.import_module(name)
    done = list(names)
    for name in optional or []:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def complete_llama_cpp() -> list[str]:
    """The rest of llama_cpp (its high-level half) where a load imported its bindings alone:
    ["llama_cpp"], or [] where llama_cpp is not imported."""
    return ["llama_cpp"] if complete() is not None else []
