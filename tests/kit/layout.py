"""The shape of a package read from its source with `ast`: its import graph and the circles in
it, and the size of every module and function. tests/test_layout.py holds edge/ to it.

The graph has an arrow for every import the code names, wherever it stands: at module level,
inside a function (a lazy import runs just the same, only later) or under `if TYPE_CHECKING:`
(the type checker follows it; a circle there is a circle in the design). Relative imports are
resolved against the importing module. `from pkg import name` points at the submodule
`pkg.name` when there is one, else at `pkg`. A package's `__init__` that Python runs on the way
to a submodule is not an arrow: the code does not name it; nor is a module imported by a string
at run time (`importlib.import_module`, which edge.lifecycle.loader uses only to time the imports phases).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Arrow", "Graph", "import_graph", "module_name", "Size", "function_sizes", "module_lines",
           "strongly_connected", "Floor", "readme_floors", "Wing", "readme_wings", "wing_strays"]


@dataclass(frozen=True)
class Arrow:
    """One import: `source` imports `target` at `line` of `path`."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.source} → {self.target} ({self.path}:{self.line})"


def module_name(path: Path, root: Path) -> str:
    """`edge/lifecycle/engines.py` → `edge.lifecycle.engines`; a package's `__init__.py` → the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Graph:
    """The modules of the package under `root` and the arrows between them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
        arrows = [a for name, path in self.files.items() for a in self._arrows(name, path)]
        self.arrows = sorted(set(arrows), key=lambda a: (a.source, a.line, a.target))

    def _arrows(self, name: str, path: Path) -> Iterator[Arrow]:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in self._targets(node, package):
                if target in self.files and target != name:
                    yield Arrow(name, target, path.relative_to(self.root.parent), node.lineno)

    def _targets(self, node: ast.AST, package: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [self._known(alias.name) for alias in node.names]
        if not isinstance(node, ast.ImportFrom):
            return []
        base = node.module or ""
        if node.level:  # relative: one level is the importing module's own package
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in self.files else self._known(base)
                for a in node.names]

    def _known(self, dotted: str) -> str:
        """`import a.b.c` names a.b.c; the longest prefix of it that is a module of ours."""
        parts = dotted.split(".")
        while parts and ".".join(parts) not in self.files:
            parts.pop()
        return ".".join(parts)

    def targets(self, name: str) -> set[str]:
        return {a.target for a in self.arrows if a.source == name}

    def circles(self) -> list[list[str]]:
        """Every strongly connected set of more than one module (Tarjan), each sorted."""
        return strongly_connected({m: self.targets(m) for m in self.files})

    def unit(self, name: str) -> str:
        """The floor a module stands on: its subpackage (`edge.model.llm` → `edge.model`), or
        the module itself at the top level (`edge.config`)."""
        return ".".join(name.split(".")[:2])

    def packages(self) -> dict[str, set[str]]:
        """The graph between floors: each subpackage or top-level module, and the others it
        imports (the package's own `__init__` is nobody's floor: it only names the package)."""
        root = self.root.name
        units = {self.unit(m) for m in self.files if m != root}
        out: dict[str, set[str]] = {u: set() for u in units}
        for a in self.arrows:
            if a.source != root and a.target != root and self.unit(a.source) != self.unit(a.target):
                out[self.unit(a.source)].add(self.unit(a.target))
        return out

    def package_circles(self) -> list[list[str]]:
        return strongly_connected(self.packages())

    def package_arrows(self, source: str, target: str) -> list[Arrow]:
        """The imports that make `source → target` between floors."""
        return [a for a in self.arrows if self.unit(a.source) == source and self.unit(a.target) == target]

    def cycle_through(self, name: str, within: list[str]) -> list[Arrow]:
        """The shortest way from `name` back to itself inside `within` (breadth first)."""
        came: dict[str, Arrow] = {}
        frontier = [name]
        while frontier:
            nxt = []
            for v in frontier:
                for a in self.arrows:
                    if a.source != v or a.target not in within or a.target in came:
                        continue
                    came[a.target] = a
                    if a.target == name:
                        return self._walk_back(came, name)
                    nxt.append(a.target)
            frontier = nxt
        return []

    @staticmethod
    def _walk_back(came: dict[str, Arrow], name: str) -> list[Arrow]:
        path = [came[name]]
        while path[-1].source != name:
            path.append(came[path[-1].source])
        return path[::-1]

    def order(self) -> list[list[str]]:
        """The modules in layers, top (imported by none of ours) to bottom (importing none of
        ours): each a layer above the lowest one it imports. The modules of a circle share one."""
        group = {m: tuple(c) for c in self.circles() for m in c}
        depth: dict[tuple[str, ...], int] = {}

        def level(node: tuple[str, ...]) -> int:
            if node not in depth:
                below = {group.get(t, (t,)) for m in node for t in self.targets(m)} - {node}
                depth[node] = 1 + max((level(n) for n in below), default=-1)
            return depth[node]

        levels = {m: level(group.get(m, (m,))) for m in self.files}
        return [sorted(m for m in self.files if levels[m] == d) for d in range(max(levels.values()), -1, -1)]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the node count
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def import_graph(root: Path) -> Graph:
    return Graph(root)


@dataclass(frozen=True)
class Size:
    """One function or method: its qualified name, where it starts, how many lines it spans."""

    name: str
    line: int
    lines: int


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def function_sizes(path: Path) -> list[Size]:
    """Every function, method and nested function, from its `def` to its last line."""
    sizes: list[Size] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                sizes.append(Size(qual, child.lineno, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return sizes


@dataclass(frozen=True)
class Floor:
    """One row of the module map (the package table of docs/internals.md, "Layout"): the packages
    (or ground-floor modules) it names, the modules its `holds` cell names, and the packages it may
    import ("ground": the ground floor)."""

    units: tuple[str, ...]
    holds: tuple[str, ...]
    imports: tuple[str, ...]


def readme_floors(text: str, package: str = "edge") -> list[Floor]:
    """The rows of the table under `| package | holds | imports |` in `text` (the "Layout" section
    of the docs, `kit.docs.section("Layout")`), top floor first; a unit is `edge.model` for
    `model/` and `edge.config` for `config.py`."""
    section = text.split("| package | holds | imports |", 1)[1].split("\n\n", 1)[0]
    floors = []
    for line in section.splitlines()[2:]:
        first, holds, imports = (c.strip() for c in line.strip().strip("|").split(" | "))
        names = re.findall(r"`([^`]+)`", first)
        units = tuple(f"{package}.{n.removesuffix('/').removesuffix('.py')}" for n in names)
        allowed = tuple(a or b for a, b in re.findall(r"`([^`]+)`|\b(ground)\b", imports))
        floors.append(Floor(units, tuple(re.findall(r"`([^`]+)`", holds)), allowed))
    return floors


@dataclass(frozen=True)
class Wing:
    """One row of the wings table (docs/internals.md, "Layout"): a folder inside a package
    (`edge.serve.schema`) and the modules of its package, outside the folder, that it may import."""

    wing: str
    imports: tuple[str, ...]

    @property
    def package(self) -> str:
        return self.wing.rpartition(".")[0]

    def holds(self, module: str) -> bool:
        return module == self.wing or module.startswith(self.wing + ".")


def readme_wings(text: str, package: str = "edge") -> list[Wing]:
    """The rows of the table under `| wing | holds | imports of its package |` in `text`: `serve/schema/`
    is the wing `edge.serve.schema`, and a module its imports cell names (`loadset`) is one of
    its package's (`edge.lifecycle.loadset`)."""
    section = text.split("| wing | holds | imports of its package |", 1)[1].split("\n\n", 1)[0]
    wings = []
    for line in section.splitlines()[2:]:
        first, _, imports = (c.strip() for c in line.strip().strip("|").split(" | "))
        wing = f"{package}.{first.strip('`').strip('/').replace('/', '.')}"
        parent = wing.rpartition(".")[0]
        wings.append(Wing(wing, tuple(f"{parent}.{n.strip('/').replace('/', '.')}"
                                      for n in re.findall(r"`([^`]+)`", imports))))
    return wings


def wing_strays(graph: Graph, wing: Wing) -> list[Arrow]:
    """The imports (lazy and TYPE_CHECKING ones included) from the wing's modules into the rest of
    its package that its row does not name: a module put in the wrong wing shows as one."""
    return [a for a in graph.arrows if wing.holds(a.source) and not wing.holds(a.target)
            and (a.target == wing.package or a.target.startswith(wing.package + "."))
            and a.target not in wing.imports]
