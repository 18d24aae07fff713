"""An unset n_ctx and parallel sized for the model and the device (edge.model.memory.context_plan):
the model's trained context where a quarter of the memory beside the weights holds its KV cache,
else what it holds; the slots from the context."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.model.gguf import read_gguf_info
from edge.model.memory import AUTO_CTX_MAX, context_plan, kv_bytes


def test_set_values_are_kept_and_unset_ones_come_from_the_trained_context(tiny_swa_gguf: Path) -> None:
    info = read_gguf_info(str(tiny_swa_gguf))
    assert info.context_length == 1024
    plenty = 1 << 40
    plan = context_plan(ModelConfig(name="m", path=str(tiny_swa_gguf)), info, plenty)
    assert (plan.n_ctx, plan.parallel) == (1024, 4) and "trained context (1024)" in plan.n_ctx_why
    set_both = context_plan(ModelConfig(name="m", path=str(tiny_swa_gguf), n_ctx=300, parallel=3), info, plenty)
    assert (set_both.n_ctx, set_both.parallel, set_both.n_ctx_why, set_both.parallel_why) == (300, 3, "n_ctx", "parallel")
    assert context_plan(ModelConfig(name="m", path=str(tiny_swa_gguf), n_ctx=8192), info, plenty).parallel == 8


def test_an_unset_context_is_what_a_quarter_of_the_memory_beside_the_weights_holds(tiny_swa_gguf: Path) -> None:
    info = read_gguf_info(str(tiny_swa_gguf))
    per_token = kv_bytes(ModelConfig(name="m", path=str(tiny_swa_gguf)), info, 1)
    small = info.data_bytes + 4 * per_token * 700  # the KV of 700 tokens in a quarter: 512 (256-aligned)
    plan = context_plan(ModelConfig(name="m", path=str(tiny_swa_gguf)), info, small)
    assert plan.n_ctx == 512 and "1/4 of the memory beside the weights" in plan.n_ctx_why
    tiny = info.data_bytes + 100  # not even that: the floor, which doctor's memory check then weighs
    assert context_plan(ModelConfig(name="m", path=str(tiny_swa_gguf)), info, tiny).n_ctx == 512


@pytest.mark.gemma
def test_a_model_trained_for_more_than_the_cap_gets_the_cap(gemma_path: Path) -> None:
    """Gemma 3 270M: trained for 32,768 tokens, the cap; 8 slots."""
    info = read_gguf_info(str(gemma_path))
    plan = context_plan(ModelConfig(name="g", path=str(gemma_path)), info, 8 << 30)  # an 8 GB Orin
    assert info.context_length == AUTO_CTX_MAX == plan.n_ctx and plan.parallel == 8
    four_k = context_plan(ModelConfig(name="g", path=str(gemma_path)), info,
                          info.data_bytes + 4 * kv_bytes(ModelConfig(name="g", path=str(gemma_path)), info, 4096))
    assert (four_k.n_ctx, four_k.parallel) == (4096, 8)
