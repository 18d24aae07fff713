"""KV-cache types per model (`type_k`/`type_v`): the sizes edge counts are ggml's own, llama.cpp
really makes such a cache, what it would refuse is refused first naming the field, the memory
guard admits ~1.9x the context at q8_0, and a saved state or warm-up plan of one type is never
taken for another."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from edge.config import ModelConfig, parse_config
from edge.device.memory import MemoryReading
from edge.errors import ConfigError
from edge.lifecycle.memguard import decide, estimate
from edge.model.gguf import GGUFInfo, read_gguf_info
from edge.model.kvtypes import GGML_TYPES, kv_type_problem
from edge.model.llm import load_gguf_model
from edge.model.memory import kv_bytes
from harness.ggufgen import write_tiny_llama

GIB = 1 << 30
from kit import EDGE, write_config


@pytest.fixture(scope="module")
def head32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose heads have 32 elements: a q8_0/q4_0 block divides them."""
    return write_tiny_llama(tmp_path_factory.mktemp("kv") / "head32.gguf", n_embd=64, n_head=2)


def model_cfg(path: Path, **fields: object) -> ModelConfig:
    return ModelConfig(name="tiny", path=str(path), n_ctx=256, n_batch=64, n_threads=1, use_mlock=False,
                       **fields)  # type: ignore[arg-type]


def test_the_sizes_edge_counts_are_ggmls_own() -> None:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_type_name.restype = ctypes.c_char_p
    for name, (ggml_type, block, size) in GGML_TYPES.items():
        assert lib.ggml_type_name(ggml_type).decode() == name
        assert (lib.ggml_blck_size(ggml_type), lib.ggml_type_size(ggml_type)) == (block, size)


def test_llama_cpp_makes_the_cache_of_the_configured_type(head32: Path) -> None:
    """The same 40 tokens' state is ~0.53x as large in q8_0 as in f16 (34 bytes a block of 32
    elements against 64), and the quantized cache still generates."""
    from edge.model.generate import GenParams, Job

    sizes, texts = {}, {}
    for kind in ("f16", "q8_0"):
        m = load_gguf_model(model_cfg(head32, type_k=kind, type_v=kind), read_gguf_info(head32))
        try:
            assert m.native.settings.flash_attn == ("on" if kind == "q8_0" else "auto")
            assert m.context_info()["type_k"] == kind
            job = Job(tokens=m.tokenize_prompt("Hello world " * 10), params=GenParams(max_tokens=4, temperature=0))
            texts[kind] = "".join(p.text for p in m.generate(job))
            used = next(i for i in range(m.native.n_seq + 1) if m.native.pos_max(i) >= 0)  # the slot it ran in
            sizes[kind] = m.native.state_size(used)
        finally:
            m.close()
    assert 0.45 < sizes["q8_0"] / sizes["f16"] < 0.6
    assert texts["q8_0"]  # decoded through the quantized cache


def test_what_llama_cpp_would_refuse_is_named_before_the_load(tiny_gguf: Path, head32: Path) -> None:
    tiny16 = read_gguf_info(tiny_gguf)  # 4 heads of 16 elements: no 32-element block divides them
    assert kv_type_problem(model_cfg(tiny_gguf, type_k="q8_0"), tiny16)[0] == "type_k"
    field, why = kv_type_problem(model_cfg(tiny_gguf, type_v="q4_0"), tiny16)
    assert field == "type_v" and "blocks of 32" in why and "16" in why
    assert kv_type_problem(model_cfg(tiny_gguf, type_k="bf16", type_v="f32"), tiny16) is None
    assert kv_type_problem(model_cfg(head32, type_k="q8_0", type_v="q4_0"), read_gguf_info(head32)) is None
    mla = _with(read_gguf_info(head32), **{"llama.attention.kv_lora_rank": 512})
    field, why = kv_type_problem(model_cfg(head32, type_k="q8_0", type_v="f16"), mla)
    assert field == "type_v" and "MLA" in why


def test_a_quantized_v_without_flash_attention_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.type_v: a quantized V cache \(q4_0\) needs flash"):
        parse_config('[[models]]\nname = "m"\npath = "x.gguf"\ntype_v = "q4_0"\nflash_attn = false\n')
    parse_config('[[models]]\nname = "m"\npath = "x.gguf"\ntype_k = "q4_0"\nflash_attn = false\n')  # K alone: fine


def test_edge_serve_exits_78_naming_the_field_llama_cpp_would_refuse(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model='type_k = "q8_0"\ntype_v = "q8_0"')
    p = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NOTIFY_SOCKET": ""})
    assert p.returncode == 78, p.stderr[-2000:]
    assert f"{cfg}: models[0].type_k: q8_0 stores blocks of 32 elements" in p.stderr
    assert "Traceback" not in p.stderr


def _with(info: GGUFInfo, **meta: object) -> GGUFInfo:
    return dataclasses.replace(info, metadata={**info.metadata, **meta})


def llama_1b(info: GGUFInfo) -> GGUFInfo:
    """A header of Llama 3.2 1B's shape (16 layers, 32 heads, 8 KV heads of 64, vocabulary 128,256)."""
    return _with(info, **{"llama.block_count": 16, "llama.embedding_length": 2048, "llama.attention.head_count": 32,
                          "llama.attention.head_count_kv": 8, "n_vocab": 128256})


def admitted_context(m: ModelConfig, info: GGUFInfo, reading: MemoryReading) -> int:
    """The longest n_ctx (in 256s) whose model the memory guard lets load beside a serving set."""
    lo, hi = 256, 1 << 22
    while hi - lo > 256:
        mid = (lo + hi) // 512 * 256
        need = estimate([(dataclasses.replace(m, n_ctx=mid), info, False)], unified=False)
        lo, hi = (mid, hi) if decide("auto", need, reading).mode == "overlap" else (lo, mid)
    return lo


@pytest.mark.parametrize("flash_attn", [True, "auto"])
def test_the_memory_guard_admits_at_least_1_8x_the_context_at_q8_0(tiny_gguf: Path, flash_attn: object) -> None:
    """Same budget, same model: the longest context the guard admits with q8_0 K and V against
    f16, both with flash attention on (like for like: 1.88x) and both left to "auto" (a quantized
    V turns flash attention on, so its attention scores are no longer counted: more)."""
    info = llama_1b(read_gguf_info(tiny_gguf))
    reading = MemoryReading(available=3 * GIB, total=8 * GIB, source="test double")
    f16 = admitted_context(model_cfg(tiny_gguf, flash_attn=flash_attn), info, reading)
    q8 = admitted_context(model_cfg(tiny_gguf, flash_attn=flash_attn, type_k="q8_0", type_v="q8_0"), info, reading)
    assert f16 >= 8192 and q8 / f16 >= 1.8, (f16, q8)


def test_the_kv_estimate_is_what_llama_cpp_allocates(head32: Path) -> None:
    """The estimate of a q8_0 cache against llama.cpp's own state of a full context: the state
    holds every cell's K and V (and a small header)."""
    m = load_gguf_model(model_cfg(head32, type_k="q8_0", type_v="q8_0"), read_gguf_info(head32))
    try:
        m.native.decode(0, list(range(3, 3 + 256)), 0)
        state = m.native.state_size(0)
        assert kv_bytes(m.cfg, m.info, m.n_ctx) <= state < kv_bytes(m.cfg, m.info, m.n_ctx) * 1.05 + 4096
    finally:
        m.close()


def test_a_state_or_plan_of_one_type_is_never_taken_for_another(head32: Path, tmp_path: Path) -> None:
    from edge.config import PrefixConfig
    from edge.device.identity import detect
    from edge.lifecycle.warmup.plan import model_plan_key
    from edge.model.identity import key_differences
    from edge.model.prefixstore import restore_prefixes

    keys, rows = {}, {}
    for kind in ("f16", "q8_0", "f16"):
        cfg = model_cfg(head32, type_k=kind, type_v=kind, prefixes=[PrefixConfig(name="sys", text="Hello world " * 5)])
        m = load_gguf_model(cfg, read_gguf_info(head32))
        try:
            (rows[kind],) = restore_prefixes(m, tmp_path, "edge.toml", "models[0]")
            keys[kind] = model_plan_key(m, detect(), "cpu")
        finally:
            m.close()
        if kind == "q8_0":
            assert rows[kind]["outcome"] == "computed" and "cache_type_k None → q8_0" in rows[kind]["why"]
    assert rows["f16"]["outcome"] == "restored"  # f16's own state, kept beside the q8_0 one
    assert "cache_type_v q8_0 → None" in key_differences(keys["q8_0"], keys["f16"])
    assert "cache_type_k" not in keys["f16"]  # f16 keys are what they were before the field existed
