"""The reload's memory guard: what a new set needs beside the old one, against what the device has.

A reload loads the new set while the old one still serves (overlap). On a Jetson the CPU and the
GPU share one DRAM, so two sets that do not both fit are an OOM kill of the whole service. Before
anything is loaded, the need is estimated from the GGUF headers and tensor tables alone (model
bytes not already mapped from the same file, KV cache, compute buffers, engines) and compared with
what the service may use: MemAvailable, or its cgroup's room where smaller (a unit's MemoryMax=,
edge.device.memory), and a discrete GPU's free memory where layers are offloaded; when it does not
fit, the reload goes sequential: the old set drains first, then the new one loads.

Unified memory (a Jetson: /etc/nv_tegra_release, or `unified=True`): llama.cpp copies offloaded
weights into GPU buffers, which are DRAM too, so they count in full whether or not the file is
mapped already (only the CPU-resident tensors share the mapped pages); KV cache, compute buffers
and deserialized engines are DRAM whichever processor uses them.

What the device has is edge.device.memory's reading; what one model needs is edge.model.memory's.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import Config, EngineConfig, ModelConfig, state_dir
from edge.device.memory import MIB, MemoryReading, process_status, unified_memory
from edge.model.gguf import GGUFInfo
from edge.model.memory import model_need
from edge.timing import RELOAD_REPORT_NAME

__all__ = ["Decision", "Need", "decide", "engine_sizes", "estimate", "handover_decision", "need_mib", "oom_before"]


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


def need_mib(m: ModelConfig, info: GGUFInfo) -> dict[str, float]:
    """What a loaded model holds, as this guard and `edge doctor` count it (edge.model.memory):
    weights, KV cache, compute buffers, the prompt cache's bound and their sum; in MiB (the start
    report's `memory_mib`)."""
    unified = m.n_gpu_layers != 0 and unified_memory()  # the driver is asked only where layers are offloaded
    return {k: round(v / MIB, 2) for k, v in model_need(m, info, shared_file=False, unified=unified).items()}


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
    """Left free for the kernel, page cache of the running set and the rest of the device (or of
    the cgroup, where its limit is below the device's memory)."""
    return min(512 * MIB, reading.ceiling // 10)


def decide(configured: str, need: Need, reading: MemoryReading | None, oom: str | None = None) -> Decision:
    """server.reload: "sequential" and "overlap" are what they say; "auto" overlaps only if the
    need fits in what the service may use (MemAvailable, or its cgroup's room) less a reserve
    (and, offloaded, in the GPU's free memory), and no OOM kill says otherwise (`oom`: why,
    from `oom_before`)."""
    if configured == "sequential":
        return Decision("sequential", "server.reload = \"sequential\"", need, reading)
    if configured == "auto" and oom:
        return Decision("sequential", oom, need, reading)
    if configured == "overlap" or reading is None:
        why = "server.reload = \"overlap\"" if configured == "overlap" else "no memory reading"
        return Decision("overlap", why, need, reading)
    room = reading.available - reserve_bytes(reading)
    shared = (" (unified memory: offloaded weights, KV cache, compute buffers and engines are all DRAM "
              "here)") if need.unified else ""
    if need.total > room:
        return Decision("sequential", f"the new set needs ~{need.total / MIB:.0f} MiB beside the old one"
                        f"{shared}, {max(room, 0) / MIB:.0f} MiB available ({_bound(reading)} less a reserve): "
                        "sequential reload, the old set drains first", need, reading)
    if need.gpu and reading.gpu_free is not None and need.gpu > reading.gpu_free:
        return Decision("sequential", f"the new set needs ~{need.gpu / MIB:.0f} MiB of GPU memory, "
                        f"{reading.gpu_free / MIB:.0f} MiB free: sequential reload", need, reading)
    return Decision("overlap", f"the new set needs ~{need.total / MIB:.0f} MiB, "
                    f"{room / MIB:.0f} MiB available: loads beside the old one", need, reading)


def _bound(reading: MemoryReading) -> str:
    """What bounded the reading, in the words a person fixes it with."""
    cg = reading.bound_by
    return f"the room under {cg.setting} of cgroup {cg.cgroup}" if cg else "MemAvailable"


def handover_decision(cfg: Config) -> dict[str, Any]:
    """Whether both processes fit: the new one needs about this process's private memory (the
    interpreter, the KV caches and compute buffers of the same models) plus the model files it
    maps that this process does not (a file mapped by both is one page cache)."""
    from edge.device.memory import read_memory
    from edge.lifecycle.installed import mapped_files

    if cfg.server.reload in ("sequential", "overlap"):
        mode = "restart" if cfg.server.reload == "sequential" else "handover"
        return {"mode": mode, "reason": f"server.reload = \"{cfg.server.reload}\"", "need_mib": None}
    oom = oom_before(state_dir(cfg))
    if oom:
        return {"mode": "restart", "reason": oom, "need_mib": None}
    mapped = mapped_files()
    new_files = 0
    for m in cfg.models:
        try:
            st = os.stat(m.path)
        except OSError:
            continue  # a builtin or missing file: the new start resolves (or refuses) it
        if (st.st_dev, st.st_ino) not in mapped and os.path.realpath(m.path) not in mapped:
            new_files += st.st_size
    need = _rss_anon() + new_files
    reading = read_memory(gpu=any(m.n_gpu_layers != 0 for m in cfg.models))
    room = reading.available - reserve_bytes(reading)
    fits = need <= room
    why = (f"the new process needs ~{need / MIB:.0f} MiB beside this one ({new_files / MIB:.0f} MiB of it "
           f"model files not mapped here), {max(room, 0) / MIB:.0f} MiB available ({reading.source} less a "
           f"reserve)")
    return {"mode": "handover" if fits else "restart", "reason": why, "need_mib": round(need / MIB, 1),
            "available_mib": round(reading.available / MIB, 1)}


def oom_before(folder: Path) -> str | None:
    """The memory guard's fallback after an OOM kill (edge.fleet.crashes, cause "oom"): when the
    last crash on record is the OOM killer ending a process that was serving (what pushes a
    serving service over is a reload's or a handover's second set) and no reload succeeded since,
    the next one does not overlap: why, or None."""
    from edge.fleet.crashes import recent_crashes
    from edge.fleet.history import read_json

    crashes = recent_crashes(folder)
    last = crashes[-1] if crashes else {}
    if last.get("cause") != "oom" or not last.get("reached_ready"):
        return None
    try:
        died = (folder / "reports" / str(last.get("record"))).stat().st_mtime  # written at its ExecStopPost=
    except OSError:
        died = float(last.get("started_unix") or 0)
    reload = read_json(folder / RELOAD_REPORT_NAME) or {}
    if not reload.get("error") and float(reload.get("started_unix") or 0) > died:
        return None
    return (f"the OOM killer ended pid {last.get('pid')} while it served (phase {last.get('phase')}) and no reload "
            "succeeded since: no second set beside the first")


def _rss_anon() -> int:
    try:
        return int(process_status().get("RssAnon", "0 kB").split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
