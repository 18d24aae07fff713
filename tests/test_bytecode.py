"""Bytecode at install, checked: what importlib would compile (`stale`), the install's compile
(`compile_missing`), `edge doctor`'s check, and a start from a fresh install with
PYTHONDONTWRITEBYTECODE=1 whose report says that it compiled nothing (and, from a copy left
without bytecode, names what it compiled)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge.bytecode import CompileWatch, compile_missing, edge_package, missing_bytecode, package_sources, stale
from kit import PidOne, write_config

EDGE_SRC = edge_package()


def _module(tmp_path: Path, text: str = "X = 1\n") -> Path:
    src = tmp_path / "mod.py"
    src.write_text(text)
    return src


def test_a_module_without_bytecode_is_named_and_then_compiled(tmp_path: Path) -> None:
    src = _module(tmp_path)
    assert stale(src) == "no bytecode"
    assert compile_missing([src]) == []
    assert stale(src) is None
    assert missing_bytecode([src]) == []


def test_checked_hash_bytecode_follows_the_source_not_its_mtime(tmp_path: Path) -> None:
    src = _module(tmp_path)
    compile_missing([src])
    st = src.stat()
    os.utime(src, (st.st_atime + 100, st.st_mtime + 100))  # a copy that did not keep mtimes
    assert stale(src) is None
    src.write_text("X = 2\n")
    assert stale(src) == "bytecode of another version of the source (hash differs)"


def test_timestamp_bytecode_is_stale_once_the_source_changes(tmp_path: Path) -> None:
    src = _module(tmp_path)
    compile_missing([src], checked_hash=False)
    assert stale(src) is None
    src.write_text("X = 22\n")  # another size
    assert stale(src) == "bytecode older than the source (mtime or size differs)"


def test_bytecode_of_another_python_is_not_valid(tmp_path: Path) -> None:
    src = _module(tmp_path)
    cached = Path(py_compile.compile(str(src)))
    cached.write_bytes(b"\0\0\r\n" + cached.read_bytes()[4:])
    assert stale(src).startswith("bytecode of another Python")


def test_a_module_that_does_not_compile_is_reported(tmp_path: Path) -> None:
    src = _module(tmp_path, "def (:\n")
    [(path, why)] = compile_missing([src])
    assert path == src and why == "does not compile: SyntaxError"


def test_the_watch_counts_an_import_compiled_from_source_not_a_parse_of_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = _module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    watch = CompileWatch()
    before = list(watch.compiled)  # this process's edge modules that had none (a checkout being edited)
    compile(src.read_text(), str(src), "exec", ast.PyCF_ONLY_AST)  # what anyio does with its own __init__
    assert watch.compiled == before
    importlib.import_module("mod")  # no bytecode: importlib compiles the source
    assert watch.stop() == [*before, str(src)]
    sys.modules.pop("mod", None)


@pytest.fixture()
def installed(tmp_path: Path) -> Path:
    """A fresh install of this edge (a copy of the package, no bytecode) under tmp/site."""
    site = tmp_path / "site"
    shutil.copytree(EDGE_SRC, site / "edge", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _env(site: Path) -> dict[str, str]:
    # PYTHONSAFEPATH: `-m` puts no working directory (a checkout's edge) before the install
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONSAFEPATH": "1"}


def _start(site: Path, cfg: Path) -> dict:
    """`edge serve` of the install at `site`, socket-activated; its start report once READY=1."""
    with PidOne([sys.executable, "-m", "edge.cli", "serve", "--config", str(cfg)], env=_env(site)) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        report = json.loads((cfg.parent / "state" / "last-start.json").read_text())
        assert pid1.stop() == 0
    return report


def _compiled_edge(report: dict, site: Path) -> list[str]:
    return [c for c in report["compiled"] if Path(c).is_relative_to(site / "edge")]


def test_a_start_from_a_compiled_install_compiles_none_of_edge(installed: Path, tmp_path: Path,
                                                                tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    bare = _start(installed, cfg)  # the install as a copy leaves it: every module compiled at start
    compiled = _compiled_edge(bare, installed)
    assert str(installed / "edge" / "__init__.py") in compiled  # imported before the watch began
    assert str(installed / "edge" / "lifecycle" / "start.py") in compiled
    assert not list(installed.rglob("*.pyc"))  # PYTHONDONTWRITEBYTECODE: nothing written either

    assert compile_missing(package_sources(installed / "edge")) == []
    report = _start(installed, cfg)
    assert _compiled_edge(report, installed) == []
    phases = [p["name"] for p in report["phases"]]
    config = next(p for p in report["phases"] if p["name"] == "config")
    assert phases[0] == "config" and config["start_s"] > 0  # measured from exec: the imports before it count
    assert config["start_s"] <= min(p["start_s"] for p in report["phases"])


def _doctor(site: Path, cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge.cli", "doctor", "--config", str(cfg)], env=_env(site),
                          capture_output=True, text=True, timeout=300, cwd=site)


def test_doctor_fails_where_edge_has_no_valid_bytecode(installed: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    r = _doctor(installed, cfg)
    line = next(x for x in r.stdout.splitlines() if "bytecode:" in x)
    assert line.startswith("[FAIL] bytecode: ") and f"of edge's modules in {installed / 'edge'} have no valid " \
        "bytecode" in line, r.stdout
    assert r.returncode == 1
    assert "--invalidation-mode checked-hash" in r.stdout

    compile_missing(package_sources(installed / "edge"))
    r = _doctor(installed, cfg)
    line = next(x for x in r.stdout.splitlines() if "bytecode:" in x)
    assert not line.startswith("[FAIL]"), r.stdout


def test_units_install_compiles_the_edge_it_installs_for(installed: Path) -> None:
    """`edge units install`'s compile step, on a fresh copy (the units themselves are
    tests/host/test_units.py's): afterwards no module of that edge would be compiled at a start."""
    code = ("from edge.cli.units import _compile\nfrom edge.host.units import default_edge_command\n"
            "_compile(default_edge_command(), '/')\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(installed), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"bytecode: {installed / 'edge'} (checked-hash) and edge's dependencies compiled" in r.stdout, r.stdout + r.stderr
    assert missing_bytecode(package_sources(installed / "edge")) == []
    r = subprocess.run([sys.executable, "-c", "from edge.cli.units import _compile\n_compile('/opt/other/edge', '/')\n"],
                       env=_env(installed), capture_output=True, text=True, timeout=300)
    assert "bytecode: not compiled here (the unit runs /opt/other/edge" in r.stderr, r.stderr
