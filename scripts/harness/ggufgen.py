"""Tiny but real GGUF models for fast tests, written with the `gguf` package.

A 2-layer llama-architecture model (64-dim, byte-level SPM vocabulary, random weights from a
seed) that llama.cpp loads and generates from in milliseconds. Its output is noise; the tests
that need meaningful text use the real Gemma model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("edge-tiny-llama")
    n_vocab = _common(w, n_ctx, n_embd, n_layer, n_ff, n_head, chat_template)
    w.add_rope_dimension_count(n_embd // n_head)

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
    return _close(w, path)


def write_tiny_gemma3(path: Path, *, seed: int = 0, n_embd: int = 64, n_layer: int = 6, n_head: int = 2,
                      n_ff: int = 128, n_ctx: int = 1024, n_swa: int = 32,
                      chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A tiny Gemma 3: sliding-window attention in five of every six layers (window `n_swa`),
    as the real one has (512), so that llama.cpp keeps and saves only each window with
    `swa_full = false`. Its output is noise, like the tiny llama's."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("edge-tiny-gemma3")
    n_vocab = _common(w, n_ctx, n_embd, n_layer, n_ff, n_head, chat_template)
    head = n_embd // n_head
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_sliding_window(n_swa)

    def t(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, n_embd))  # tied: the output reuses it
    w.add_tensor("output_norm.weight", ones(n_embd))
    for i in range(n_layer):
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(n_embd))
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(head))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(n_embd, n_ff))
    return _close(w, path)


def byte_token(b: int) -> int:
    """The id of the tiny models' token for byte `b` (`<0xNN>`, after <unk>, <s>, </s>)."""
    return 3 + b


def _common(w: Any, n_ctx: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
            chat_template: str | None) -> int:
    """The shape and the byte-level vocabulary both tiny models share; the vocabulary's size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    words = [" the", " a", "e", "t", "o", "n", " Hello", "Hello", " world", "."]
    tokens += [word.replace(" ", "\u2581") for word in words]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)  # unknown, control x2, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
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
    return len(tokens)


def _close(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LORA_TARGETS = ("attn_q", "attn_v", "ffn_up")


def write_tiny_lora(path: Path, *, seed: int = 1, n_embd: int = 64, n_layer: int = 2, n_ff: int = 128,
                    rank: int = 4, alpha: float = 8.0, arch: str = "llama", std: float = 0.5,
                    targets: tuple[str, ...] = LORA_TARGETS) -> Path:
    """A LoRA adapter for `write_tiny_llama`'s model (same n_embd, n_layer, n_ff), as llama.cpp's
    convert_lora_to_gguf lays one out: general.type "adapter", adapter.type "lora",
    adapter.lora.alpha, and for each adapted weight W (n_out x n_in) `W.lora_a` (rank x n_in) and
    `W.lora_b` (n_out x rank); llama.cpp adds scale x alpha / rank x B·A·x to W·x. `std` large
    enough that the adapter moves the logits well past float noise."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    shapes = {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_embd), "attn_v": (n_embd, n_embd),
              "attn_output": (n_embd, n_embd), "ffn_up": (n_ff, n_embd), "ffn_gate": (n_ff, n_embd),
              "ffn_down": (n_embd, n_ff)}
    for i in range(n_layer):
        for name in targets:
            n_out, n_in = shapes[name]
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", (rng.standard_normal((rank, n_in)) * std).astype(np.float32))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    return _close(w, path)


def write_lora_for(base: Path, path: Path, *, seed: int = 1, rank: int = 8, alpha: float = 16.0,
                   std: float = 0.02, targets: tuple[str, ...] = ("attn_q", "attn_v")) -> Path:
    """A random LoRA adapter for any GGUF model `base` (Gemma 3 270M included): its architecture
    and every `blk.N.<target>.weight`'s shape read from the base's own header (gguf.GGUFReader)."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(base))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in targets and parts[3] == "weight":
            n_in, n_out = int(t.shape[0]), int(t.shape[1])  # ggml order: ne[0] is the input
            w.add_tensor(f"{t.name}.lora_a", (rng.standard_normal((rank, n_in)) * std).astype(np.float32))
            w.add_tensor(f"{t.name}.lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    return _close(w, path)
