"""The reload's memory guard: what a new set needs beside the old one, against what the device has.

A reload loads the new set while the old one still serves (overlap). On a Jetson the CPU and the
GPU share one DRAM, so two sets that do not both fit are an OOM kill of the whole service. Before
anything is loaded, the need is estimated from the GGUF headers and tensor tables alone (model
bytes not already mapped from the same file, KV cache, compute buffers, engines) and compared with
MemAvailable (and with a discrete GPU's free memory where layers are offloaded); when it does not
fit, the reload goes sequential: the old set drains first, then the new one loads.

Unified memory (a Jetson: /etc/nv_tegra_release, or `unified=True`): llama.cpp copies offloaded
weights into GPU buffers, which are DRAM too, so they count in full whether or not the file is
mapped already (only the CPU-resident tensors share the mapped pages); KV cache, compute buffers
and deserialized engines are DRAM whichever processor uses them.

The memory reading is one function, `read_memory()`. Its test double is a file in /proc/meminfo
format named by $EDGE_TEST_MEMINFO (`TEST_MEMINFO_ENV`): the same parsing, another file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import Config, EngineConfig, ModelConfig
from edge.model.gguf import GGUFInfo, offload_split

__all__ = ["Decision", "MemoryReading", "Need", "TEST_MEMINFO_ENV", "decide", "engine_sizes",
           "estimate", "kv_bytes", "prompt_cache_bytes", "read_memory", "unified_memory"]

MEMINFO = Path("/proc/meminfo")
TEGRA_RELEASE = "etc/nv_tegra_release"
TEST_MEMINFO_ENV = "EDGE_TEST_MEMINFO"  # test double of the memory reading: a meminfo-format file
MIB = 1 << 20
CONTEXT_OVERHEAD = 16 * MIB  # per llama.cpp context: graph metadata, scratch, tokenizer tables


@dataclass(frozen=True)
class MemoryReading:
    available: int  # MemAvailable, bytes
    total: int  # MemTotal, bytes
    gpu_free: int | None = None  # a discrete GPU's free bytes; None: unified memory or unknown
    source: str = str(MEMINFO)

    def as_dict(self) -> dict[str, Any]:
        return {"available_mib": self.available // MIB, "total_mib": self.total // MIB,
                "gpu_free_mib": None if self.gpu_free is None else self.gpu_free // MIB,
                "source": self.source}


def read_memory(gpu: bool = False) -> MemoryReading:
    """MemAvailable/MemTotal from /proc/meminfo (or the test double); a discrete GPU's free
    memory through nvidia-smi when `gpu` (layers offloaded) and this is not a Jetson."""
    path = Path(os.environ.get(TEST_MEMINFO_ENV) or MEMINFO)
    fields: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # kB
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    gpu_free = _gpu_free() if gpu and not unified_memory() else None
    return MemoryReading(available, total, gpu_free, str(path))


def unified_memory(root: str | Path = "/") -> bool:
    """A Jetson: its integrated GPU's buffers are the CPU's DRAM."""
    return (Path(root) / TEGRA_RELEASE).exists()


def _gpu_free() -> int | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return min(int(x) for x in out.split()) * MIB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


@dataclass
class Need:
    """Bytes the new set needs beyond what is mapped already, per model or engine and in all:
    `dram` of each is what counts against MemAvailable, `gpu` against a discrete GPU's memory."""

    models: dict[str, dict[str, int]] = field(default_factory=dict)
    unified: bool = False

    @property
    def total(self) -> int:
        return sum(m["dram"] for m in self.models.values())

    @property
    def gpu(self) -> int:
        return sum(m["gpu"] for m in self.models.values())

    def as_dict(self) -> dict[str, Any]:
        return {"total_mib": round(self.total / MIB, 1), "gpu_mib": round(self.gpu / MIB, 1),
                "unified_memory": self.unified,
                "models": {n: {k: round(v / MIB, 2) for k, v in m.items()} for n, m in self.models.items()}}


def _int(meta: dict[str, Any], key: str, default: int) -> int:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


def kv_bytes(m: ModelConfig, info: GGUFInfo) -> int:
    """The f16 KV cache of n_ctx tokens: every layer's K and V, from the GGUF header."""
    meta, arch = info.metadata, info.architecture
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    k_len = _int(meta, f"{arch}.attention.key_length", _int(meta, f"{arch}.embedding_length", 1) // n_head or 1)
    v_len = _int(meta, f"{arch}.attention.value_length", k_len)
    return (_int(meta, f"{arch}.block_count", 1) * m.n_ctx
            * _int(meta, f"{arch}.attention.head_count_kv", n_head) * (k_len + v_len) * 2)


def model_need(m: ModelConfig, info: GGUFInfo, shared_file: bool, unified: bool = False) -> dict[str, int]:
    """One model: its weights (CPU-resident ones 0 when the same file is mapped already), the f16
    KV cache of n_ctx tokens, and the compute buffers llama.cpp sizes by n_batch (an upper
    estimate). Offloaded weights are copies (llama.cpp's GPU buffers): on unified memory they are
    DRAM whether or not the file is mapped."""
    meta, arch = info.metadata, info.architecture
    n_layer = _int(meta, f"{arch}.block_count", 1)
    n_embd = _int(meta, f"{arch}.embedding_length", 1)
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    n_vocab = _int(meta, "n_vocab", 32000)
    n_ctx, n_batch = m.n_ctx, min(m.n_batch, m.n_ctx)
    kv = kv_bytes(m, info)
    # logits of one batch, the attention scores of one batch against the context, activations
    compute = 4 * n_batch * (n_vocab + n_head * n_ctx + 4 * n_embd) + CONTEXT_OVERHEAD
    if m.n_gpu_layers != 0 and info.tensors:
        split = offload_split(info, m.n_gpu_layers, None)
        cpu_weights, gpu_weights = split.cpu, split.gpu
    else:
        cpu_weights, gpu_weights = info.data_bytes, 0
    weights = (0 if shared_file and m.use_mmap else cpu_weights) + (gpu_weights if unified else 0)
    offloaded = 1.0 if m.n_gpu_layers < 0 else min(1.0, m.n_gpu_layers / n_layer)
    gpu = gpu_weights + int(offloaded * kv) + (compute if offloaded else 0)
    # declared and learned prefix states are restored into the prompt cache before the switch
    cache = prompt_cache_bytes(m, kv) if m.prefixes or m.learn_prefixes else 0
    return {"model": weights, "kv_cache": kv, "compute": compute, "prompt_cache": cache, "gpu": gpu,
            "dram": weights + kv + compute + cache}


def prompt_cache_bytes(m: ModelConfig, kv_bytes: int, total_ram: int | None = None) -> int:
    """The prompt cache's bound (edge.model.promptcache): `prompt_cache_mb`, or when unset the KV of
    two full contexts (`kv_bytes`: one context's), at most 1/16 of RAM."""
    if m.prompt_cache_mb is not None:
        return m.prompt_cache_mb << 20
    total = read_memory().total if total_ram is None else total_ram
    return min(2 * kv_bytes, total // 16) if total else 2 * kv_bytes


def engine_need(nbytes: int, unified: bool) -> dict[str, int]:
    """A deserialized engine holds about its plan's size in device memory (plus activations,
    sized by the profiles, not known here): DRAM on unified memory, GPU memory on a dGPU."""
    return {"engine": nbytes, "gpu": 0 if unified else nbytes, "dram": nbytes if unified else 0}


def estimate(models: list[tuple[ModelConfig, GGUFInfo, bool]], engines: Sequence[tuple[str, int]] = (),
             unified: bool | None = None) -> Need:
    """The need of what a reload loads: models as (config, GGUF header, file mapped already),
    engines as (name, stored file size); `unified` defaults to this machine's (unified_memory())."""
    unified = unified_memory() if unified is None else unified
    need = Need({m.name: model_need(m, info, shared, unified) for m, info, shared in models}, unified)
    need.models.update({name: engine_need(nbytes, unified) for name, nbytes in engines})
    return need


def engine_sizes(cfg: Config, engines: Sequence[EngineConfig]) -> list[tuple[str, int]]:
    """(name, file size) of the stored engine each of `engines` would load on this device (the
    store's manifest knows the size); one not found is not counted (the load itself will fail)."""
    if not engines:
        return []
    from edge.device.identity import detect
    from edge.engines.lookup import configured_engines

    names = {e.name for e in engines}
    return [(e.name, stored.bytes) for e, stored in configured_engines(cfg, detect())
            if e.name in names and not isinstance(stored, Exception)]


@dataclass(frozen=True)
class Decision:
    mode: str  # overlap | sequential
    reason: str
    need: Need
    reading: MemoryReading | None

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason, "need": self.need.as_dict(),
                "reading": self.reading.as_dict() if self.reading else None}


def reserve_bytes(reading: MemoryReading) -> int:
    """Left free for the kernel, page cache of the running set and the rest of the device."""
    return min(512 * MIB, reading.total // 10)


def decide(configured: str, need: Need, reading: MemoryReading | None) -> Decision:
    """server.reload: "sequential" and "overlap" are what they say; "auto" overlaps only if the
    need fits in MemAvailable less a reserve (and, offloaded, in the GPU's free memory)."""
    if configured == "sequential":
        return Decision("sequential", "server.reload = \"sequential\"", need, reading)
    if configured == "overlap" or reading is None:
        why = "server.reload = \"overlap\"" if configured == "overlap" else "no memory reading"
        return Decision("overlap", why, need, reading)
    room = reading.available - reserve_bytes(reading)
    shared = (" (unified memory: offloaded weights, KV cache, compute buffers and engines are all DRAM "
              "here)") if need.unified else ""
    if need.total > room:
        return Decision("sequential", f"the new set needs ~{need.total / MIB:.0f} MiB beside the old one"
                        f"{shared}, {max(room, 0) / MIB:.0f} MiB available (MemAvailable less a reserve): "
                        "sequential reload, the old set drains first", need, reading)
    if need.gpu and reading.gpu_free is not None and need.gpu > reading.gpu_free:
        return Decision("sequential", f"the new set needs ~{need.gpu / MIB:.0f} MiB of GPU memory, "
                        f"{reading.gpu_free / MIB:.0f} MiB free: sequential reload", need, reading)
    return Decision("overlap", f"the new set needs ~{need.total / MIB:.0f} MiB, "
                    f"{room / MIB:.0f} MiB available: loads beside the old one", need, reading)
