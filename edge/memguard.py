"""The reload's memory guard: what a new set needs beside the old one, against what the device has.

A reload loads the new set while the old one still serves (overlap). On a Jetson the CPU and the
GPU share one DRAM, so two sets that do not both fit are an OOM kill of the whole service. Before
anything is loaded, the need is estimated from the GGUF headers alone (model bytes not already
mapped from the same file, KV cache, compute buffers) and compared with MemAvailable (and with a
discrete GPU's free memory where layers are offloaded); when it does not fit, the reload goes
sequential: the old set drains first, then the new one loads.

The memory reading is one function, `read_memory()`. Its test double is a file in /proc/meminfo
format named by $EDGE_TEST_MEMINFO (`TEST_MEMINFO_ENV`): the same parsing, another file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import ModelConfig
from edge.gguf import GGUFInfo

__all__ = ["MemoryReading", "Need", "Decision", "read_memory", "estimate", "decide", "TEST_MEMINFO_ENV"]

MEMINFO = Path("/proc/meminfo")
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
    gpu_free = _gpu_free() if gpu and not Path("/etc/nv_tegra_release").exists() else None
    return MemoryReading(available, total, gpu_free, str(path))


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
    """Bytes the new set needs beyond what is mapped already, per model and in all."""

    models: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(m["model"] + m["kv_cache"] + m["compute"] for m in self.models.values())

    @property
    def gpu(self) -> int:
        return sum(m["gpu"] for m in self.models.values())

    def as_dict(self) -> dict[str, Any]:
        return {"total_mib": round(self.total / MIB, 1), "gpu_mib": round(self.gpu / MIB, 1),
                "models": {n: {k: round(v / MIB, 2) for k, v in m.items()} for n, m in self.models.items()}}


def _int(meta: dict[str, Any], key: str, default: int) -> int:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


def model_need(m: ModelConfig, info: GGUFInfo, shared_file: bool) -> dict[str, int]:
    """One model: its weights (0 when the same file is mapped already), the f16 KV cache of
    n_ctx tokens, and the compute buffers llama.cpp sizes by n_batch (an upper estimate)."""
    meta, arch = info.metadata, info.architecture
    n_layer = _int(meta, f"{arch}.block_count", 1)
    n_embd = _int(meta, f"{arch}.embedding_length", 1)
    n_head = _int(meta, f"{arch}.attention.head_count", 1)
    n_head_kv = _int(meta, f"{arch}.attention.head_count_kv", n_head)
    k_len = _int(meta, f"{arch}.attention.key_length", n_embd // n_head or 1)
    v_len = _int(meta, f"{arch}.attention.value_length", k_len)
    n_vocab = _int(meta, "n_vocab", 32000)
    n_ctx, n_batch = m.n_ctx, min(m.n_batch, m.n_ctx)
    kv = n_layer * n_ctx * n_head_kv * (k_len + v_len) * 2
    # logits of one batch, the attention scores of one batch against the context, activations
    compute = 4 * n_batch * (n_vocab + n_head * n_ctx + 4 * n_embd) + CONTEXT_OVERHEAD
    weights = 0 if shared_file and m.use_mmap else info.data_bytes
    offloaded = 1.0 if m.n_gpu_layers < 0 else min(1.0, m.n_gpu_layers / n_layer)
    gpu = int(offloaded * (info.data_bytes + kv)) + (compute if offloaded else 0)
    return {"model": weights, "kv_cache": kv, "compute": compute, "gpu": gpu}


def estimate(models: list[tuple[ModelConfig, GGUFInfo, bool]]) -> Need:
    """The need of the models a reload loads: (config, GGUF header, file mapped already)."""
    return Need({m.name: model_need(m, info, shared) for m, info, shared in models})


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
    if need.total > room:
        return Decision("sequential", f"the new set needs ~{need.total / MIB:.0f} MiB beside the old one, "
                        f"{max(room, 0) / MIB:.0f} MiB available (MemAvailable less a reserve): "
                        "sequential reload, the old set drains first", need, reading)
    if need.gpu and reading.gpu_free is not None and need.gpu > reading.gpu_free:
        return Decision("sequential", f"the new set needs ~{need.gpu / MIB:.0f} MiB of GPU memory, "
                        f"{reading.gpu_free / MIB:.0f} MiB free: sequential reload", need, reading)
    return Decision("overlap", f"the new set needs ~{need.total / MIB:.0f} MiB, "
                    f"{room / MIB:.0f} MiB available: loads beside the old one", need, reading)
