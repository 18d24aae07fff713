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
    assert check.level == "ok" and "n_ctx = 300 (n_ctx), 3 slots (parallel)" in check.message
    auto = write_config(tmp_path / "auto.toml", tiny_gguf, n_ctx=256)
    assert "n_ctx = 256 (n_ctx), 4 slots (automatic: one per 512 tokens of n_ctx, 4 to 8)" in _model_check(
        auto, tmp_path).message


def test_an_unset_context_is_the_models_trained_one_and_said_so(tmp_path: Path, tiny_gguf: Path) -> None:
    """Neither n_ctx nor parallel set: the context the GGUF says the model was trained for (the tiny
    model's 512 fits any memory), the slots from it; doctor states both and why."""
    from edge.model.gguf import read_gguf_info

    trained = read_gguf_info(str(tiny_gguf)).context_length
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    cfg.write_text(cfg.read_text().replace("n_ctx = 256\n", ""))
    message = _model_check(cfg, tmp_path).message
    assert f"n_ctx = {trained} (automatic: the model's trained context ({trained}))" in message
    assert "4 slots (automatic" in message
