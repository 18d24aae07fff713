"""`edge doctor`'s model check: how many requests a model decodes at once (its slots) and what
each can count on of the shared context."""

from __future__ import annotations

from pathlib import Path

from edge.host.doctor import run_checks
from kit import write_config


def _model_check(cfg: Path, tmp_path: Path):
    return next(c for c in run_checks(str(cfg), [tmp_path / "no-units"]) if c.name == "model tiny")


def test_the_model_check_says_how_many_slots_share_the_context(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=300, extra_model="parallel = 3")
    check = _model_check(cfg, tmp_path)
    assert check.level == "ok" and "3 slots (parallel) sharing n_ctx = 300 cells: 100 tokens" in check.message
    auto = write_config(tmp_path / "auto.toml", tiny_gguf, n_ctx=256)
    assert "4 slots (parallel, automatic) sharing n_ctx = 256 cells: 64 tokens" in _model_check(auto, tmp_path).message
