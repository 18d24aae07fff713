"""The memory this machine has: MemAvailable and MemTotal, a discrete GPU's free memory, and
whether CPU and GPU share one DRAM (a Jetson).

The memory reading is one function, `read_memory()`. Its test double is a file in /proc/meminfo
format named by $EDGE_TEST_MEMINFO (`TEST_MEMINFO_ENV`): the same parsing, another file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MIB", "MemoryReading", "TEST_MEMINFO_ENV", "read_memory", "unified_memory"]

MEMINFO = Path("/proc/meminfo")
TEGRA_RELEASE = "etc/nv_tegra_release"
TEST_MEMINFO_ENV = "EDGE_TEST_MEMINFO"  # test double of the memory reading: a meminfo-format file
MIB = 1 << 20


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


def unified_memory(root: str | Path = "/", integrated: Callable[[], bool | None] | None = None) -> bool:
    """The GPU's buffers are the CPU's DRAM (a Jetson's integrated GPU), as the driver says
    (CU_DEVICE_ATTRIBUTE_INTEGRATED of GPU 0, edge.device.cuda.integrated_gpu: right inside a
    container that lacks /etc/nv_tegra_release too); where no driver can say (no cuda-python, no
    driver library, no usable GPU), whether <root>/etc/nv_tegra_release exists. `integrated`: the
    driver's answer (a test passes a double at that boundary)."""
    if integrated is None:
        from edge.device.cuda import integrated_gpu as integrated
    said = integrated()
    return said if said is not None else (Path(root) / TEGRA_RELEASE).exists()


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
