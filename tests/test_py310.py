"""Python 3.10 (JetPack 6): nothing in edge/ needs a newer Python, and config and recipe parsing
work through tomli, the parser edge.toml uses where tomllib is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERMIN = [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())"]


def test_edge_needs_nothing_newer_than_python_3_10() -> None:
    pytest.importorskip("vermin", reason="vermin comes with the dev extra")
    # tomllib is excluded because edge/toml.py imports it only on 3.11+ (tomli below)
    r = subprocess.run([*VERMIN, "--target=3.10-", "--no-tips", "--violations",
                        "--eval-annotations", "--exclude", "tomllib", str(ROOT / "edge")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"Python 3.10 violations in edge/:\n{r.stdout}{r.stderr}"


def test_vermin_catches_a_violation(tmp_path: Path) -> None:
    pytest.importorskip("vermin", reason="vermin comes with the dev extra")
    (tmp_path / "new.py").write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")
    r = subprocess.run([*VERMIN, "--target=3.10-", "--no-tips", "--violations",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "3.11" in r.stdout


PROBE = r"""
import json, sys
sys.version_info = (3, 10, 12, "final", 0)  # what JetPack 6 runs: edge.toml must pick tomli
import edge.toml
from edge.config import parse_config
from edge.engines.recipe import load_recipe
from edge.errors import ConfigError
cfg = parse_config(sys.argv[1], source="edge.toml")
recipe = load_recipe(sys.argv[2])
try:
    parse_config("[server\nport = 1", source="bad.toml")
    bad = None
except ConfigError as exc:
    bad = str(exc)
print(json.dumps({"parser": edge.toml._toml.__name__, "port": cfg.server.port,
                  "engine": cfg.engines[0].name, "recipe": recipe.name,
                  "profiles": [p.name for p in recipe.profiles], "bad": bad}))
"""


def test_config_and_recipe_parse_through_tomli(tmp_path: Path) -> None:
    pytest.importorskip("tomli", reason="tomli comes with the dev extra")
    text = ('[server]\nport = 0\n[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\n'
            f'recipe = "{ROOT / "engines" / "mlp-demo.toml"}"\n')
    r = subprocess.run([sys.executable, "-c", PROBE, text, str(ROOT / "engines" / "mlp-demo.toml")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["parser"] == "tomli"
    assert (out["port"], out["engine"], out["recipe"], out["profiles"]) == (0, "mlp", "mlp-demo", ["default"])
    assert out["bad"].startswith("bad.toml") and "TOML" in out["bad"]
