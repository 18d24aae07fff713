"""Bytecode: compiled at install, checked by `edge doctor`, watched at start.

The unit runs with ProtectSystem=strict (and this machine class often with
PYTHONDONTWRITEBYTECODE=1), so a start can never write the bytecode it lacks: whatever the install
leaves is what every start pays, and compiling edge's own modules from source costs more than the
rest of the path to the config together. So the install compiles them (`compile_missing`: scripts/setup,
`edge units install`), `edge doctor` fails where a module has no valid bytecode (`stale`), and each
start reports which source files it compiled (`CompileWatch`: an audit hook on `compile`, the call
importlib makes for a module without valid bytecode).

Edge's own modules are compiled with checked-hash invalidation: an editable install's sources change
under it, and an OTA or image copy need not keep their mtimes; a checked hash is valid exactly while
the source is the one compiled, whatever its mtime, and the check costs a hash of a file already read.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CompileWatch", "compile_missing", "dependency_sources", "edge_package", "missing_bytecode",
           "package_sources", "stale"]

_HASH_BASED, _CHECK_SOURCE = 0b01, 0b10


def edge_package() -> Path:
    """The directory of the edge this Python imports (the installed one, or a checkout)."""
    return Path(__file__).resolve().parent


def stale(source: Path) -> str | None:
    """Why `source` would be compiled when imported (None: its bytecode is valid), by the checks
    importlib makes: the magic number of this Python, then the source's mtime and size, or its hash."""
    try:
        cached = Path(importlib.util.cache_from_source(str(source)))
        with open(cached, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return "no bytecode"
    except (OSError, ValueError, NotImplementedError) as exc:
        return f"bytecode unreadable: {exc}"
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return f"bytecode of another Python ({cached.name})"
    flags = int.from_bytes(head[4:8], "little")
    try:
        if flags & _HASH_BASED:
            same = importlib.util.source_hash(source.read_bytes()) == head[8:16]
            return None if same else "bytecode of another version of the source (hash differs)"
        st = source.stat()
    except OSError as exc:
        return f"source unreadable: {exc.strerror or exc}"
    if int.from_bytes(head[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF \
            or int.from_bytes(head[12:16], "little") != st.st_size & 0xFFFFFFFF:
        return "bytecode older than the source (mtime or size differs)"
    return None


def package_sources(root: Path) -> list[Path]:
    """Every module under `root` (a package's directory)."""
    return [p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]


def missing_bytecode(sources: Iterable[Path]) -> list[tuple[Path, str]]:
    """Every module of `sources` that an import would compile, with why."""
    return [(p, why) for p in sources if (why := stale(p)) is not None]


def compile_missing(sources: Iterable[Path], *, checked_hash: bool = True) -> list[tuple[Path, str]]:
    """Compile every module of `sources` whose bytecode is not valid: checked-hash pycs for edge's
    own code; `checked_hash=False`: timestamp pycs, as pip writes them into site-packages. Returns
    the modules that still have none, with why (a read-only directory, a syntax error)."""
    import py_compile

    mode = py_compile.PycInvalidationMode.CHECKED_HASH if checked_hash else py_compile.PycInvalidationMode.TIMESTAMP
    failed = []
    for path, _ in missing_bytecode(sources):
        try:
            py_compile.compile(str(path), doraise=True, invalidation_mode=mode)
        except py_compile.PyCompileError as exc:
            failed.append((path, f"does not compile: {exc.exc_type_name}"))
        except OSError as exc:
            failed.append((path, f"cannot write its bytecode: {exc.strerror or exc}"))
    return failed


class CompileWatch:
    """The source files this process compiles from now on (an audit hook on `compile`, which
    importlib calls with the file's path for a module without valid bytecode), and those of edge's
    modules imported before the watch began that had none."""

    def __init__(self) -> None:
        self.compiled: list[str] = [str(p) for p in self._loaded_edge_sources() if stale(p) is not None]
        self.watching = True
        sys.addaudithook(self._hook)  # for the process's life: hooks cannot be removed

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "compile" and self.watching and len(args) > 1 and isinstance(args[1], str) \
                and args[1].endswith(".py") and _importing():
            self.compiled.append(args[1])

    def stop(self) -> list[str]:
        """What was compiled up to now (the hook stays, doing nothing)."""
        self.watching = False
        return list(self.compiled)

    @staticmethod
    def _loaded_edge_sources() -> list[Path]:
        out = set()
        for module in list(sys.modules.values()):  # by the spec's name: `-m edge.cli` runs as __main__
            spec = getattr(module, "__spec__", None)
            name, origin = getattr(spec, "name", None) or "", getattr(spec, "origin", None)
            if (name == "edge" or name.startswith("edge.")) and origin and origin.endswith(".py"):
                out.add(Path(origin))
        return sorted(out)


def _importing() -> bool:
    """Whether the `compile` being audited is importlib's of a module's source (its loader's
    source_to_code), not a library parsing a file for its AST (anyio reads its own __init__)."""
    caller = sys._getframe(2)  # 0: this function, 1: the hook, 2: compile()'s caller
    return caller.f_code.co_name == "_call_with_frames_removed" and caller.f_back is not None \
        and caller.f_back.f_code.co_name == "source_to_code"


def dependency_sources(top: str = "edge") -> list[Path]:
    """The modules of the installed distributions `top` depends on, directly or not (extras
    left out; test suites too: a start never imports them), from their RECORD files."""
    from importlib import metadata

    seen: set[str] = set()
    todo, found = [top], []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if key != top:
            found += [Path(str(dist.locate_file(f))) for f in dist.files or ()
                      if f.suffix == ".py" and not _SKIPPED.intersection(f.parts)]
        todo += [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or () if "extra ==" not in r]
    return found


_SKIPPED = {"tests", "test", "testing", "examples", "benchmarks", "__pycache__"}
