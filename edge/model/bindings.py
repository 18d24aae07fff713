"""llama-cpp-python imported in two halves, so that a start loads its model sooner.

`import llama_cpp` runs the package's `__init__`: the ctypes bindings (`llama_cpp.llama_cpp`:
libllama loaded, its functions declared; about 30 ms on the project's 2-core VM) and then the
high-level half (`llama_cpp.llama`: numpy, jinja2, diskcache, the chat formats; about 130 ms).
A model's load needs the bindings alone, and llama.cpp loads with the GIL released, so a start
imports the bindings first (`import_bindings`), loads the model with them, and completes the
package meanwhile (`complete`): the high-level half is then off the start's critical path.

Between the two the package is in `sys.modules` with the bindings' names, as its `from
.llama_cpp import *` gives them; its submodules import as usual (`llama_cpp.llama_chat_format`).
`complete` runs the package's own `__init__` in that module, which makes it the package a plain
`import llama_cpp` makes. Only a start and a reload call these; everything else imports llama_cpp
the plain way, and once the package is complete both are the same module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

__all__ = ["complete", "import_bindings", "is_partial"]

_PARTIAL = "_edge_bindings_only"  # set on the package module while its __init__ has not run
_lock = threading.Lock()


def import_bindings() -> ModuleType:
    """The `llama_cpp` package with its bindings imported and its high-level half not yet (or the
    whole package, where it is imported already). ImportError (name "llama_cpp") where
    llama-cpp-python is not installed; any other import error as it is."""
    with _lock:
        pkg = sys.modules.get("llama_cpp")
        if pkg is not None:
            return pkg
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError("No module named 'llama_cpp'", name="llama_cpp")
        pkg = importlib.util.module_from_spec(spec)  # the package's __path__, its __init__ not run
        setattr(pkg, _PARTIAL, True)
        sys.modules["llama_cpp"] = pkg
        try:
            bindings = importlib.import_module("llama_cpp.llama_cpp")
        except BaseException:
            sys.modules.pop("llama_cpp", None)
            sys.modules.pop("llama_cpp.llama_cpp", None)
            raise
        names = getattr(bindings, "__all__", None) or [n for n in vars(bindings) if not n.startswith("_")]
        pkg.__dict__.update({n: getattr(bindings, n) for n in names})  # `from .llama_cpp import *`
        pkg.llama_cpp = bindings
        return pkg


def is_partial() -> bool:
    """True while the package holds the bindings only (import_bindings ran, complete not yet)."""
    pkg = sys.modules.get("llama_cpp")
    return pkg is not None and bool(getattr(pkg, _PARTIAL, False))


def complete() -> ModuleType | None:
    """Run the package's own `__init__` in the partial package (the high-level half: numpy, jinja2,
    the chat formats); None where llama_cpp is not imported. The names it sets are those a plain
    import gives; the bindings module is the same object."""
    with _lock:
        pkg = sys.modules.get("llama_cpp")
        if pkg is None or not getattr(pkg, _PARTIAL, False):
            return pkg
        assert pkg.__spec__ is not None and pkg.__spec__.loader is not None
        pkg.__spec__.loader.exec_module(pkg)
        delattr(pkg, _PARTIAL)
        return pkg
