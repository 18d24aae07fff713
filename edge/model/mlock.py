"""mlock: what must be locked, what is, why not, and the `require_mlock` policy.

llama.cpp asks for mlock and carries on silently when RLIMIT_MEMLOCK refuses it, leaving the
model pageable; edge measures VmLck around the load instead of trusting the request, compares it
with what the model should have locked, and either warns (saying how to fix it) or, with
`require_mlock = true`, stops the start (exit 77). `edge doctor` predicts the same from the
limits before a start.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.config import BUILTIN_PREFIX, Config, ModelConfig
from edge.device.memory import process_status
from edge.errors import MlockError
from edge.model.gguf import GGUFInfo, offload_split

__all__ = ["MlockStatus", "vm_locked_bytes", "mlock_status", "enforce", "models_bytes",
           "memlock_verdict", "mib", "BUILTIN_MODEL_BYTES"]

log = logging.getLogger("edge")

BUILTIN_MODEL_BYTES = 253_113_024  # the packaged Gemma 3 270M Q4_K_M
CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class MlockStatus:
    requested: bool
    locked_bytes: int  # VmLck growth over the load
    expected_bytes: int  # tensor data that should be resident and locked
    limit_bytes: int | None  # RLIMIT_MEMLOCK soft limit; None = unlimited
    cap_ipc_lock: bool
    min_share: float = 0.98  # of expected_bytes that must be locked (page rounding; see below)
    duplicated_bytes: int = 0  # tied embeddings loaded a second time for an offloaded output layer
    gpu_bytes: int = 0  # weights llama.cpp copies into GPU buffers (not locked: not the mapping)

    @property
    def ok(self) -> bool:
        return not self.requested or self.locked_bytes >= self.expected_bytes * self.min_share

    def explain(self) -> str:
        if not self.requested:
            return "mlock disabled by config (use_mlock = false)"
        if self.ok:
            return f"mlock ok: {self.locked_bytes / 2**20:.1f} MiB locked"
        limit = "unlimited" if self.limit_bytes is None else f"{self.limit_bytes / 2**20:.1f} MiB"
        return (f"mlock did not take: {self.locked_bytes / 2**20:.1f} MiB locked of "
                f"{self.expected_bytes / 2**20:.1f} MiB model data; RLIMIT_MEMLOCK is {limit} and the "
                "process lacks CAP_IPC_LOCK. Fix: set LimitMEMLOCK=infinity in the unit "
                "(edge's edge.service does), or run `ulimit -l unlimited` before `edge serve`. "
                "The model stays pageable and may be evicted under memory pressure.")

    def as_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "ok": self.ok, "locked_bytes": self.locked_bytes,
                "expected_bytes": self.expected_bytes, "min_share": self.min_share,
                "limit_bytes": self.limit_bytes, "cap_ipc_lock": self.cap_ipc_lock,
                "gpu_bytes": self.gpu_bytes, "duplicated_bytes": self.duplicated_bytes}


def vm_locked_bytes() -> int:
    """VmLck of this process in bytes."""
    return int(process_status().get("VmLck", "0 kB").split()[0]) * 1024


def mlock_status(requested: bool, locked_bytes: int, info: GGUFInfo, *, use_mmap: bool,
                 n_gpu_layers: int, output_first: bool | None | str = "installed") -> MlockStatus:
    """What should be locked: with mmap, the mapped tensor data; without, llama.cpp's CPU
    buffers (repacked quantized tensors live outside them: ~95% measured on Gemma 3 Q4_K_M).
    With GPU offload, a mapped file is locked from its start to the end of the last CPU-resident
    tensor (the token embeddings, the blocks left on the CPU, the output layer when it is not
    offloaded), offloaded tensors stored before it included, page-rounded; without mmap, the
    CPU-resident tensors' buffers: from the GGUF tensor table and llama.cpp's placement rule
    (edge.model.gguf.offload_split; `output_first`: that rule's version, by default read from
    the installed llama.cpp)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap_eff = int(process_status().get("CapEff", "0").strip(), 16)
    share = 0.98 if use_mmap else 0.9
    expected, gpu, duplicated = info.data_bytes, 0, 0
    if n_gpu_layers != 0:
        if output_first == "installed":
            from edge.model.gpu import output_layer_first

            output_first = output_layer_first()
        split = offload_split(info, n_gpu_layers, output_first if isinstance(output_first, bool) else None)
        page = os.sysconf("SC_PAGE_SIZE")
        expected = -(-split.locked // page) * page if use_mmap else split.cpu
        gpu, duplicated = split.gpu, split.duplicated
    return MlockStatus(requested=requested, locked_bytes=locked_bytes, expected_bytes=expected,
                       limit_bytes=None if soft == resource.RLIM_INFINITY else soft,
                       cap_ipc_lock=bool(cap_eff & (1 << CAP_IPC_LOCK)), min_share=share,
                       gpu_bytes=gpu, duplicated_bytes=duplicated)


def enforce(m: ModelConfig, status: MlockStatus) -> None:
    """The `require_mlock` policy: a lock that did not take stops the start, or is a warning."""
    if status.ok:
        return
    if m.require_mlock:
        raise MlockError(f"{m.name}: {status.explain()}")
    log.warning("%s: %s", m.name, status.explain())


def models_bytes(cfg: Config) -> int:
    """Bytes of model files the config would lock (before a start: from the files' sizes)."""
    total = 0
    for m in cfg.models:
        p = Path(m.path)
        if m.path.startswith(BUILTIN_PREFIX):
            total += BUILTIN_MODEL_BYTES
        elif p.is_file():
            total += p.stat().st_size
    return total


def mib(n: int) -> str:
    """Bytes as MiB for messages: one decimal below 10 MiB."""
    return f"{n / 2**20:.1f} MiB" if n < 10 * 2**20 else f"{n / 2**20:.0f} MiB"


def memlock_verdict(cfg: Config) -> tuple[str, str, str]:
    """Will the models lock for `edge serve` started from this process? (level ok|warn|fail,
    message, fix), from its RLIMIT_MEMLOCK and capabilities. Under the unit, doctor checks the
    unit's LimitMEMLOCK= and the running service's real limit instead."""
    need = models_bytes(cfg)
    if not any(m.use_mlock for m in cfg.models):
        return "ok", "use_mlock is off for every model: nothing to lock", ""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() == 0:
        return "ok", f"running as root (CAP_IPC_LOCK): {mib(need)} of models can be locked", ""
    if soft == resource.RLIM_INFINITY or soft >= need:
        return "ok", f"RLIMIT_MEMLOCK of this shell allows locking {mib(need)} of models", ""
    return ("warn", f"RLIMIT_MEMLOCK is {mib(soft)}, the models are {mib(need)}: `edge serve` "
            "from this shell cannot lock them",
            "run `ulimit -l unlimited` first, or run under edge.service (LimitMEMLOCK=infinity)")
