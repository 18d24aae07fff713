"""The memory a start may really use: MemAvailable, bounded by the limit of the process's cgroup
(edge.device.cgroup: a unit's MemoryMax=/MemoryHigh=, a container's limit), a discrete GPU's free
memory, and whether CPU and GPU share one DRAM (a Jetson).

The memory reading is one function, `read_memory()`: `available` is the smaller of MemAvailable
and the cgroup's room (its limit less its working set), and `source` says which bounded it. Its
test doubles: a file in /proc/meminfo format named by $EDGE_TEST_MEMINFO (`TEST_MEMINFO_ENV`), and
a tree of cgroup files named by $EDGE_TEST_CGROUP_ROOT. The double replaces the whole reading:
with $EDGE_TEST_MEMINFO set, the cgroup is read only from $EDGE_TEST_CGROUP_ROOT (none when unset),
so a test's numbers do not depend on the cgroup it happens to run in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.device.cgroup import TEST_CGROUP_ROOT_ENV, CgroupLimit, memory_limit

__all__ = ["MIB", "MemoryReading", "TEST_MEMINFO_ENV", "process_status", "read_memory", "unified", "unified_memory"]

MEMINFO = Path("/proc/meminfo")
TEGRA_RELEASE = "etc/nv_tegra_release"
TEST_MEMINFO_ENV = "EDGE_TEST_MEMINFO"  # test double of the memory reading: a meminfo-format file
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryReading:
    available: int  # bytes a start may use: MemAvailable, or the cgroup's room where smaller
    total: int  # MemTotal, bytes
    gpu_free: int | None = None  # a discrete GPU's free bytes; None: unified memory or unknown
    source: str = f"{MEMINFO} MemAvailable"  # what bounded `available`
    cgroup: CgroupLimit | None = None  # the cgroup limit that leaves the least room, if any

    @property
    def bound_by(self) -> CgroupLimit | None:
        """The cgroup limit when it, not MemAvailable, bounded `available`."""
        return self.cgroup if self.source.startswith("cgroup ") else None

    @property
    def ceiling(self) -> int:
        """The most this process's cgroup may ever hold: MemTotal, or the cgroup's limit."""
        return min(self.total, self.cgroup.limit) if self.cgroup else self.total

    def as_dict(self) -> dict[str, Any]:
        return {"available_mib": self.available // MIB, "total_mib": self.total // MIB,
                "gpu_free_mib": None if self.gpu_free is None else self.gpu_free // MIB,
                "source": self.source, "cgroup": self.cgroup.as_dict() if self.cgroup else None}


def process_status() -> dict[str, str]:
    """This process's /proc/self/status, field -> its text ("VmLck" -> "   1024 kB")."""
    with open("/proc/self/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def read_memory(gpu: bool = False, pid: int | str = "self") -> MemoryReading:
    """MemAvailable/MemTotal from /proc/meminfo (or the test double), bounded by the limit of
    `pid`'s cgroup; a discrete GPU's free memory through nvidia-smi when `gpu` (layers
    offloaded) and this is not a Jetson."""
    double = os.environ.get(TEST_MEMINFO_ENV)
    path = Path(double or MEMINFO)
    fields: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # kB
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    gpu_free = _gpu_free() if gpu and not unified_memory() else None
    limit = None if double and not os.environ.get(TEST_CGROUP_ROOT_ENV) else memory_limit(pid)
    if limit is not None and limit.room < available:
        return MemoryReading(limit.room, total, gpu_free, f"cgroup {limit.cgroup} {limit.setting}", limit)
    return MemoryReading(available, total, gpu_free, f"{path} MemAvailable", limit)


def unified_memory(root: str | Path = "/", integrated: Callable[[], bool | None] | None = None) -> bool:
    """The GPU's buffers are the CPU's DRAM (a Jetson's integrated GPU), as the driver says
    (CU_DEVICE_ATTRIBUTE_INTEGRATED of GPU 0, edge.device.cuda.integrated_gpu: right inside a
    container that lacks /etc/nv_tegra_release too); where no driver can say (no cuda-python, no
    driver library, no usable GPU), whether <root>/etc/nv_tegra_release exists. `integrated`: the
    driver's answer (a test passes a double at that boundary)."""
    if integrated is None:
        from edge.device.cuda import integrated_gpu as integrated
    return unified(integrated(), (Path(root) / TEGRA_RELEASE).exists())


def unified(integrated: bool | None, jetson: bool) -> bool:
    """The one rule for unified memory (this function and DeviceInfo.unified_memory): what the
    driver says of GPU 0 (an IGX board's dGPU as device 0 is not, although the board is a
    Jetson), else whether this is a Jetson."""
    return integrated if integrated is not None else jetson


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
