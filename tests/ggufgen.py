"""Tiny but real GGUF models for fast tests, written with the `gguf` package.

A 2-layer llama-architecture model (64-dim, byte-level SPM vocabulary, random weights from a
seed) that llama.cpp loads and generates from in milliseconds. Its output is noise; the tests
that need meaningful text use the real Gemma model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_llama(path: Path, *, seed: int = 0, n_embd: int = 64, n_layer: int = 2,
                     n_head: int = 4, n_ff: int = 128, n_ctx: int = 512,
                     chat_template: str | None = CHAT_TEMPLATE, tied: bool = False) -> Path:
    """`tied`: no output.weight (the output layer reuses token_embd, as Gemma's does)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    words = [" the", " a", "e", "t", "o", "n", " Hello", "Hello", " world", "."]
    tokens += [w.replace(" ", "\u2581") for w in words]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)  # unknown, control x2, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("edge-tiny-llama")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    def t(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", t(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
