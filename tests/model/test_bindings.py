"""llama-cpp-python imported in two halves (edge.model.bindings): a start's load needs only the
ctypes bindings; the high-level half (numpy, jinja2, the chat formats) comes beside the load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge.errors import MissingDependency
from edge.lifecycle.backends import import_modules

_TWO_HALVES = """\
import json, sys
from edge.model import bindings
pkg = bindings.import_bindings()
half = {"partial": bindings.is_partial(), "numpy": "numpy" in sys.modules,
        "jinja2": "jinja2" in sys.modules, "llama": "llama_cpp.llama" in sys.modules,
        "init": callable(getattr(pkg, "llama_backend_init", None)), "Llama": hasattr(pkg, "Llama"),
        "version": getattr(pkg, "__version__", None)}
bindings_module = pkg.llama_cpp
done = bindings.complete()
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
whole = {"partial": bindings.is_partial(), "same": done is pkg and llama_cpp is pkg,
         "bindings_same": llama_cpp.llama_cpp is bindings_module, "Llama": hasattr(llama_cpp, "Llama"),
         "version": llama_cpp.__version__, "again": bindings.complete() is pkg}
print(json.dumps([half, whole]))
"""


def test_bindings_first_then_the_package_whole() -> None:
    r = subprocess.run([sys.executable, "-c", _TWO_HALVES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    half, whole = json.loads(r.stdout)
    # the bindings alone: what a model's load calls, without the high-level half's imports
    assert half == {"partial": True, "numpy": False, "jinja2": False, "llama": False, "init": True,
                    "Llama": False, "version": None}
    from importlib.metadata import version

    # completed: the package a plain `import llama_cpp` makes, the bindings module unchanged
    assert whole == {"partial": False, "same": True, "bindings_same": True, "Llama": True,
                     "version": version("llama-cpp-python"), "again": True}


def test_a_plain_import_first_is_left_as_it_is() -> None:
    import llama_cpp

    from edge.model import bindings

    assert bindings.import_bindings() is llama_cpp
    assert not bindings.is_partial()
    assert bindings.complete() is llama_cpp


def test_llama_cpp_missing_is_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else None)
    with pytest.raises(MissingDependency) as err:
        import_modules(["llama_cpp.llama_cpp"])
    assert "llama-cpp-python" in str(err.value) and "GGUF" in str(err.value)
    assert "llama_cpp" not in sys.modules  # nothing half-made left behind


def test_an_optional_module_that_is_not_there_is_skipped() -> None:
    assert import_modules(["json"], ["anyio._backends._asyncio", "edge_no_such_module"]) == \
        ["json", "anyio._backends._asyncio"]
