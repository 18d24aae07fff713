"""What this machine is: Jetson module and L4T release, SM arch, CUDA, TensorRT, ONNX Runtime, CPU.

Every file read takes a `root`, so tests run detection over fixture trees of real Orin, Xavier,
Nano and dGPU layouts. The one GPU query (compute capability through pycuda or cuda-python) is
passed in as a callable: the hardware boundary, replaced by a double in tests.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DeviceInfo", "SOC_SM", "detect", "query_gpu_sm", "sm_for_soc"]

# Jetson SoC (device-tree "compatible") -> SM arch of its integrated GPU
SOC_SM = {"tegra264": "sm_110", "tegra234": "sm_87", "tegra194": "sm_72", "tegra186": "sm_62",
          "tegra210": "sm_53"}
TRT_DISTS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-lean-cu13", "tensorrt-lean",
             "tensorrt-cu13-bindings", "tensorrt-cu12-bindings", "tensorrt-lean-cu13-bindings")


@dataclass(frozen=True)
class DeviceInfo:
    cpu_arch: str
    jetson_model: str | None
    soc: str | None
    l4t_release: str | None
    sm: str | None
    sm_source: str | None  # "gpu" (queried) | "soc-table" | None
    cuda: str | None  # MAJ.MIN
    tensorrt: str | None  # MAJ.MIN.PATCH
    onnxruntime: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(errors="replace")
    except OSError:
        return None


def sm_for_soc(compatible: list[str]) -> tuple[str | None, str | None]:
    for entry in compatible:
        soc = entry.split(",")[-1]
        if soc in SOC_SM:
            return soc, SOC_SM[soc]
    return None, None


def _l4t(text: str | None) -> str | None:
    # "# R36 (release), REVISION: 3.0, GCID: ..., BOARD: generic, EABI: aarch64, DATE: ..."
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _cuda(root: Path) -> str | None:
    text = _read(root, "usr/local/cuda/version.json")
    if text:
        try:
            version = json.loads(text)["cuda"]["version"]
            return ".".join(version.split(".")[:2])
        except (ValueError, KeyError, TypeError):
            pass
    m = re.search(r"CUDA Version (\d+)\.(\d+)", _read(root, "usr/local/cuda/version.txt") or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _trt_version(root: Path) -> str | None:
    v = _dist_version(TRT_DISTS)
    if v is None:  # JetPack installs TensorRT as a Debian package, not a wheel
        m = re.search(r"NV_TENSORRT_MAJOR (\d+).*?NV_TENSORRT_MINOR (\d+).*?NV_TENSORRT_PATCH (\d+)",
                      _read(root, "usr/include/aarch64-linux-gnu/NvInferVersion.h")
                      or _read(root, "usr/include/x86_64-linux-gnu/NvInferVersion.h") or "", re.S)
        return ".".join(m.groups()) if m else None
    return ".".join(v.split(".")[:3])


def query_gpu_sm() -> str | None:
    """Compute capability of GPU 0 through pycuda or cuda-python; None where there is no GPU."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        major, minor = cuda.Device(0).compute_capability()
        return f"sm_{major}{minor}"
    except Exception:  # no pycuda, no driver, no device: all mean "not queryable here"
        pass
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        attr = driver.CUdevice_attribute
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0)
        return f"sm_{major}{minor}" if major else None
    except Exception:
        return None


def detect(root: str | Path = "/", gpu_query: Callable[[], str | None] = query_gpu_sm,
           cpu_arch: str | None = None) -> DeviceInfo:
    root = Path(root)
    model = (_read(root, "proc/device-tree/model") or "").strip("\x00\n ") or None
    compatible = [c for c in (_read(root, "proc/device-tree/compatible") or "").split("\x00") if c]
    soc, table_sm = sm_for_soc(compatible)
    queried = gpu_query()
    sm, source = (queried, "gpu") if queried else (table_sm, "soc-table" if table_sm else None)
    return DeviceInfo(cpu_arch=cpu_arch or platform.machine(), jetson_model=model if soc else None,
                      soc=soc, l4t_release=_l4t(_read(root, "etc/nv_tegra_release")), sm=sm,
                      sm_source=source, cuda=_cuda(root), tensorrt=_trt_version(root),
                      onnxruntime=_dist_version(("onnxruntime", "onnxruntime-gpu")))
