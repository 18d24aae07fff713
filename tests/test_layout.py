"""The house: no import circle in edge/ (lazy and TYPE_CHECKING imports included), neither between
modules nor between packages; every package importing only what its row of the module map (docs/internals.md, "Layout")
names, from floors beneath it; a ground floor of at most 9 top-level modules that import
no package; the lifecycle's data flowing one way (start → reload → serving → loader → loadset →
timing); modules of at most 400 lines and functions of at most 50 (DESIGN.md, "Data flows one
way"; STYLE.md); every folder of a package a wing that imports of its package only what its row of
the wings table names; tests that mirror the packages and take their helpers from tests/kit/, not
from conftest.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kit.docs import section
from kit.layout import function_sizes, import_graph, module_lines, readme_floors, readme_wings, wing_strays

PACKAGE = Path(__file__).resolve().parent.parent / "edge"
GRAPH = import_graph(PACKAGE)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
MAX_GROUND_MODULES = 9  # bytecode joined the eight: why, in the module map's words above its table
FLOORS = readme_floors(section("Layout"))  # the module map, docs/internals.md
GROUND = next(f for f in FLOORS if not f.imports)  # the ground floor imports only itself ("one another")
WINGS = readme_wings(section("Layout"))  # a package's folders, and what each may import of its package

# Modules another helper is changing in its own branch: the lead removes these marks once that
# branch is merged (strict=False: they pass as soon as the fix is here).
@pytest.mark.parametrize("module", sorted(GRAPH.files))
def test_module_is_in_no_import_circle(module: str) -> None:
    circle = next((c for c in GRAPH.circles() if module in c), None)
    assert circle is None, (f"{module} is in the import circle {{{', '.join(circle)}}}; the shortest "
                            "loop through it: " + "; ".join(map(str, GRAPH.cycle_through(module, circle))))


def test_no_circle_between_packages() -> None:
    found = []
    for circle in GRAPH.package_circles():
        arrows = [str(a) for s in circle for d in circle for a in GRAPH.package_arrows(s, d)[:2]]
        found.append(f"{{{', '.join(circle)}}}: " + "; ".join(arrows))
    assert not found, "circles between packages (a floor imports one above or beside it): " + " | ".join(found)


def test_the_ground_floor_is_small_and_imports_no_package() -> None:
    top = sorted(m for m in GRAPH.files if m.count(".") == 1 and GRAPH.files[m].parent == PACKAGE)
    assert len(top) <= MAX_GROUND_MODULES, f"{len(top)} top-level modules (at most {MAX_GROUND_MODULES}): {top}"
    assert set(top) == set(GROUND.units), "the module map's ground floor row is not the top level"
    up = [str(a) for a in GRAPH.arrows if a.source in top and a.target not in top and a.target != "edge"]
    assert not up, "the ground floor imports a package: " + "; ".join(up)


@pytest.mark.parametrize("floor", [f.units[0] for f in FLOORS if f is not GROUND])
def test_a_package_imports_only_what_its_row_names_from_floors_beneath(floor: str) -> None:
    row = next(i for i, f in enumerate(FLOORS) if floor in f.units)
    named = {u for a in FLOORS[row].imports for u in (GROUND.units if a == "ground" else (f"edge.{a}",))}
    above = [u for a in FLOORS[row].imports if a != "ground"
             for u in (f"edge.{a}",) if next(i for i, f in enumerate(FLOORS) if u in f.units) <= row]
    assert not above, f"{floor}'s row names {above}, which stand on its floor or above it"
    unnamed = [str(a) for t in sorted(GRAPH.packages()[floor] - named) for a in GRAPH.package_arrows(floor, t)]
    assert not unnamed, f"{floor} imports what its row of the module map does not name: " + "; ".join(unnamed)


def test_every_package_is_a_row() -> None:
    rows = {u for f in FLOORS for u in f.units}
    assert set(GRAPH.packages()) == rows


def test_every_folder_of_a_package_is_a_wing() -> None:
    folders = {m for m, path in GRAPH.files.items() if path.name == "__init__.py" and m.count(".") >= 2}
    assert folders == {w.wing for w in WINGS}, "the wings table of the module map is not the folders of the packages"


@pytest.mark.parametrize("wing", [w.wing for w in WINGS])
def test_a_wing_imports_of_its_package_only_what_its_row_names(wing: str) -> None:
    row = next(w for w in WINGS if w.wing == wing)
    missing = [m for m in row.imports if m not in GRAPH.files]
    assert not missing, f"{wing}'s row names modules that do not exist: {missing}"
    strays = [str(a) for a in wing_strays(GRAPH, row)]
    assert not strays, f"{wing} imports of its package what its row of the wings table does not name: " + "; ".join(strays)


def test_tests_mirror_the_packages() -> None:
    tests = Path(__file__).resolve().parent
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders - {"system"} <= packages, f"test folders that are no package: {sorted(folders - packages)}"
    loose = sorted(p.name for p in tests.glob("test_*.py")
                   if p.stem.removeprefix("test_") not in {m.split(".")[1] for m in GROUND.units} | {"layout", "readme", "py310", "docs"})
    assert not loose, f"tests at tests/ that belong in a package's folder: {loose}"


def test_the_lifecycle_flows_one_way() -> None:
    """start takes the reloader and the dispatcher; reload takes the dispatcher; both make their
    sets with the loader; the loaded set's types sit below them all, the phase names lowest."""
    lifecycle = ["edge.lifecycle.start", "edge.lifecycle.reload", "edge.lifecycle.serving", "edge.lifecycle.loader", "edge.lifecycle.loadset", "edge.timing"]
    below = {m: lifecycle[i + 1:] for i, m in enumerate(lifecycle)}
    up = [str(a) for a in GRAPH.arrows if a.source in below and a.target in lifecycle
          and a.target not in below[a.source]]
    assert not up, "imports that run back up the lifecycle: " + "; ".join(up)
    assert "edge.lifecycle.loader" in GRAPH.targets("edge.lifecycle.start") & GRAPH.targets("edge.lifecycle.reload")
    assert GRAPH.targets("edge.lifecycle.serving") & set(lifecycle) <= {"edge.lifecycle.loadset"}


@pytest.mark.parametrize("module", sorted(GRAPH.files))
def test_module_size(module: str) -> None:
    lines = module_lines(GRAPH.files[module])
    assert lines <= MAX_MODULE_LINES, f"{GRAPH.files[module]} has {lines} lines (at most {MAX_MODULE_LINES})"


@pytest.mark.parametrize("module", sorted(GRAPH.files))
def test_function_sizes(module: str) -> None:
    path = GRAPH.files[module]
    big = [f"{s.name} ({path}:{s.line}, {s.lines} lines)" for s in function_sizes(path) if s.lines > MAX_FUNCTION_LINES]
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(big)


def test_tests_take_their_helpers_from_the_kit_not_from_conftest() -> None:
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(tests)}:{node.lineno}" for n in names if n.split(".")[0] == "conftest"]
    assert not found, "helpers belong in tests/kit/ (fixtures stay in conftest.py): " + ", ".join(found)


# -- the checks themselves, on packages made for them --------------------------------------------
def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_every_kind_of_import_makes_an_arrow_and_every_circle_is_found(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",  # relative, a submodule by name
        "pkg/b.py": "def f():\n    from .c import x  # lazy\n    return x\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nx = 1\n",
        "pkg/d.py": "import pkg.sub.e\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from .. import d\n",  # two levels up
        "pkg/f.py": "import os\nfrom pkg import d\n",  # outside the package: no arrow
    })
    g = import_graph(pkg)
    assert g.circles() == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.sub.e"]]
    loop = g.cycle_through("pkg.a", ["pkg.a", "pkg.b", "pkg.c"])
    assert [(a.source, a.target, a.line) for a in loop] == [("pkg.a", "pkg.b", 1), ("pkg.b", "pkg.c", 2),
                                                          ("pkg.c", "pkg.a", 3)]
    assert g.targets("pkg.f") == {"pkg.d"}


def test_a_package_is_ordered_top_to_bottom_with_a_circle_on_one_layer(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "from pkg import mid, low\n",
                              "pkg/mid.py": "from pkg.low import x\n", "pkg/low.py": "x = 1\n"})
    assert import_graph(pkg).order() == [["pkg.top"], ["pkg.mid"], ["pkg", "pkg.low"]]
    (pkg / "mid.py").write_text("from pkg.low import x\nfrom pkg import side\n")
    (pkg / "side.py").write_text("def f():\n    from pkg import mid\n")
    assert import_graph(pkg).order() == [["pkg.top"], ["pkg.mid", "pkg.side"], ["pkg", "pkg.low"]]


def test_circles_between_packages_are_found_through_any_module(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"pkg/__init__.py": "", "pkg/ground.py": "x = 1\n",
                              "pkg/low/__init__.py": "", "pkg/low/a.py": "from pkg.ground import x\n",
                              "pkg/low/b.py": "def f():\n    from pkg.high.c import y\n",  # lazy, but an arrow
                              "pkg/high/__init__.py": "", "pkg/high/c.py": "from pkg.low.a import x\ny = 2\n"})
    g = import_graph(pkg)
    assert g.circles() == []  # no circle between modules ...
    assert g.package_circles() == [["pkg.high", "pkg.low"]]  # ... but one between their packages
    assert g.packages()["pkg.low"] == {"pkg.ground", "pkg.high"}
    assert [a.target for a in g.package_arrows("pkg.low", "pkg.high")] == ["pkg.high.c"]


def test_function_sizes_count_methods_and_nested_functions(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(50))
    path = tmp_path / "m.py"
    path.write_text(f"class C:\n    def big(self):\n{body.replace('    ', '        ')}\n"
                    f"def outer():\n    def inner():\n        pass\n    return inner\n")
    sizes = {s.name: s.lines for s in function_sizes(path)}
    assert sizes == {"C.big": 51, "outer": 4, "outer.inner": 2}


def test_a_module_in_the_wrong_wing_is_found(tmp_path: Path) -> None:
    """The wing check on a package made for it: an HTTP route put in the schema wing imports the
    app, and a warm-up module that reaches for the start (lazily) are both found; what the rows
    name, and the wing's own modules, are not."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "", "pkg/serve/__init__.py": "",
        "pkg/serve/app.py": "from pkg.serve.schema import convert\nx = 1\n",
        "pkg/serve/schema/__init__.py": "", "pkg/serve/schema/convert.py": "from pkg.serve.schema import enums\n",
        "pkg/serve/schema/enums.py": "y = 1\n",
        "pkg/serve/schema/routes.py": "from pkg.serve.app import x\n",  # misplaced: it belongs beside the app
        "pkg/lifecycle/__init__.py": "", "pkg/lifecycle/loadset.py": "", "pkg/lifecycle/start.py": "",
        "pkg/lifecycle/warmup/__init__.py": "", "pkg/lifecycle/warmup/steps.py": "from pkg.lifecycle import loadset\n",
        "pkg/lifecycle/warmup/late.py": "def f():\n    from pkg.lifecycle.start import g\n",
    })
    table = ("| wing | holds | imports of its package |\n| --- | --- | --- |\n"
             "| `serve/schema/` | grammars | none |\n| `lifecycle/warmup/` | warm-up | `loadset` |\n")
    schema, warmup = readme_wings(table, "pkg")
    assert (schema.wing, schema.imports, warmup.imports) == ("pkg.serve.schema", (), ("pkg.lifecycle.loadset",))
    g = import_graph(pkg)
    assert [(a.source, a.target) for a in wing_strays(g, schema)] == [("pkg.serve.schema.routes", "pkg.serve.app")]
    assert [(a.source, a.target, a.line) for a in wing_strays(g, warmup)] == [("pkg.lifecycle.warmup.late",
                                                                             "pkg.lifecycle.start", 2)]
    (pkg / "serve" / "schema" / "routes.py").unlink()  # moved where it belongs: nothing left to find
    (pkg / "lifecycle" / "warmup" / "late.py").write_text("from pkg.lifecycle.loadset import z\n")
    g = import_graph(pkg)
    assert wing_strays(g, schema) == [] and wing_strays(g, warmup) == []
