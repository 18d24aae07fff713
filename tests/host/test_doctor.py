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


def test_the_model_check_gives_the_kv_cache_by_type_and_fails_what_llama_cpp_refuses(
        tmp_path: Path, tiny_gguf: Path) -> None:
    """KV types (issue 55): the cache's size in its types, the embeddings context beside it; a
    type whose block does not divide the model's heads (16 elements here) is a fail naming it."""
    f16 = _model_check(write_config(tmp_path / "f16.toml", tiny_gguf, n_ctx=4096), tmp_path)
    f32 = _model_check(write_config(tmp_path / "f32.toml", tiny_gguf, n_ctx=4096,
                                    extra_model='type_k = "f32"\ntype_v = "f32"\nembeddings = true'), tmp_path)
    assert "KV cache f16: 2.0 MiB at n_ctx = 4096" in f16.message  # 2 layers x 4096 x 4 heads x (16+16) x 2 bytes
    assert "KV cache f32: 4.0 MiB at n_ctx = 4096" in f32.message and "embeddings context: " in f32.message
    bad = _model_check(write_config(tmp_path / "q8.toml", tiny_gguf, extra_model='type_k = "q8_0"'), tmp_path)
    assert bad.level == "fail" and "models.type_k: q8_0 stores blocks of 32 elements" in bad.message


def test_each_adapter_is_checked_against_its_model_as_the_load_will(tmp_path: Path, tiny_gguf: Path) -> None:
    """LoRA adapters (issue 55): a good one ok with its alpha and scale; a file that is no LoRA
    adapter, or one made for another architecture, a fail naming the file and the field."""
    from harness.ggufgen import write_tiny_lora

    good = write_tiny_lora(tmp_path / "good.gguf")
    other = write_tiny_lora(tmp_path / "other.gguf", arch="gemma3")
    tables = "".join(f'\n[[models.adapters]]\nname = "{n}"\npath = "{p}"\nscale = 0.5\n'
                     for n, p in (("good", good), ("model", tiny_gguf), ("other", other)))
    checks = {c.name: c for c in run_checks(str(write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=tables)),
                                            [tmp_path / "no-units"])}
    assert checks["adapter tiny:good"].level == "ok" and "alpha 8.0, default scale 0.5" in checks["adapter tiny:good"].message
    model, arch = checks["adapter tiny:model"], checks["adapter tiny:other"]
    assert model.level == "fail" and "general.type is None, expected 'adapter'" in model.message
    assert arch.level == "fail" and "general.architecture is 'gemma3', expected 'llama'" in arch.message
    assert "models[0].adapters[2].path" in arch.message and str(other) in arch.message


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
