"""What this machine is: Jetson module and L4T release, GPU (name, SM arch), CUDA, TensorRT, ONNX Runtime, CPU.

Every file read takes a `root`, so tests run detection over fixture trees of real Orin (JetPack 5
and 6), Xavier, Nano, dGPU and pip-assembled CUDA layouts. Two things are asked of the running
software rather than of files, and both are parameters so tests pass doubles at that boundary:
the GPU (`probe_gpu`, through cuda-python's driver and runtime APIs) and the TensorRT module that
would deserialize an engine (`tensorrt_version`, read from the module without importing it).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DeviceInfo", "GpuInfo", "SOC_SM", "detect", "probe_gpu", "sm_for_soc", "tensorrt_version",
           "slug"]

# Jetson SoC (device-tree "compatible") -> SM arch of its integrated GPU
SOC_SM = {"tegra264": "sm_110", "tegra234": "sm_87", "tegra194": "sm_72", "tegra186": "sm_62",
          "tegra210": "sm_53"}
# pip-assembled CUDA (no /usr/local/cuda): the runtime wheel's version is the toolkit's
CUDART_DISTS = ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime")
TRT_DISTS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-bindings",
             "tensorrt-cu12-bindings", "tensorrt-lean", "tensorrt-lean-cu13", "tensorrt-lean-cu12")


@dataclass(frozen=True)
class GpuInfo:
    """GPU 0 as the CUDA driver reports it."""

    name: str  # "Orin", "NVIDIA H100 80GB HBM3", ...
    sm: str  # sm_87
    cuda_runtime: str | None = None  # MAJ.MIN of the loaded libcudart (cudaRuntimeGetVersion)
    cuda_driver: str | None = None  # MAJ.MIN the driver supports (cuDriverGetVersion)


@dataclass(frozen=True)
class DeviceInfo:
    cpu_arch: str
    jetson_model: str | None
    soc: str | None
    l4t_release: str | None
    sm: str | None
    sm_source: str | None  # "gpu" (queried) | "soc-table" | None
    cuda: str | None  # MAJ.MIN
    tensorrt: str | None  # the module's own __version__, build number included where it has one
    onnxruntime: str | None
    gpu_name: str | None = None
    cuda_source: str | None = None  # cudart | driver | version.json | version.txt | pip | None
    cuda_driver: str | None = None

    @property
    def platform(self) -> str | None:
        """What an engine's tactics were timed on beyond the SM arch: Orin AGX, NX and Nano all
        report sm_87 (and "Orin"), with different SM counts and memory; so a Jetson is its module,
        a dGPU its CPU arch and product name (plans are not portable across host platforms: an
        H100 PCIe in an x86 and in an aarch64 server are two platforms)."""
        if self.jetson_model:
            return slug(self.jetson_model.replace("NVIDIA ", "").replace(" Developer Kit", ""))
        return slug(f"{self.cpu_arch} {self.gpu_name}") if self.gpu_name else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "platform": self.platform}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


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


DistVersion = Callable[[tuple[str, ...]], "str | None"]


def _cuda_from_tree(root: Path, dists: DistVersion) -> tuple[str | None, str | None]:
    """The toolkit's version from files, for hosts where the runtime cannot be asked. Absent
    files are normal (runtime-only and pip-assembled installs): then None, never an error."""
    text = _read(root, "usr/local/cuda/version.json")
    if text:
        try:
            return ".".join(json.loads(text)["cuda"]["version"].split(".")[:2]), "version.json"
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    m = re.search(r"CUDA Version (\d+)\.(\d+)", _read(root, "usr/local/cuda/version.txt") or "")
    if m:
        return f"{m.group(1)}.{m.group(2)}", "version.txt"
    v = dists(CUDART_DISTS)
    return (".".join(v.split(".")[:2]), "pip") if v else (None, None)


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tensorrt_version() -> str | None:
    """`__version__` of the `tensorrt` module an engine would be deserialized with (JetPack's
    system package, or a wheel), read from its __init__.py so that nothing is imported; the
    loaded module's own value when it is already imported."""
    loaded = sys.modules.get("tensorrt")
    if loaded is not None:
        return str(getattr(loaded, "__version__", "")) or None
    try:
        spec = importlib.util.find_spec("tensorrt")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_text(errors="replace"))
    except (OSError, SyntaxError):
        tree = None
    for node in tree.body if tree else []:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return _dist_version(TRT_DISTS)


def _cuda_modules() -> tuple[Any, Any]:
    """cuda-python's driver and runtime modules (cuda.bindings since 12.6, cuda.* before)."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        from cuda import cuda as driver, cudart as runtime  # type: ignore[no-redef]
    return driver, runtime


def _maj_min(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # 12060 -> 12.6


def probe_gpu() -> GpuInfo | None:
    """GPU 0 through cuda-python; None where there is no cuda-python, driver or device."""
    try:
        driver, runtime = _cuda_modules()
        ok = driver.CUresult.CUDA_SUCCESS
        if driver.cuInit(0)[0] != ok:
            return None
        err, dev = driver.cuDeviceGet(0)
        if err != ok:
            return None
        attr = driver.CUdevice_attribute
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, raw = driver.cuDeviceGetName(256, dev)
        err_d, drv = driver.cuDriverGetVersion()
        err_r, rt = runtime.cudaRuntimeGetVersion()
    except Exception:  # ImportError, or a driver library that cannot load: "no GPU here"
        return None
    name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
    return GpuInfo(name=name, sm=f"sm_{major}{minor}",
                   cuda_runtime=_maj_min(rt) if err_r == runtime.cudaError_t.cudaSuccess else None,
                   cuda_driver=_maj_min(drv) if err_d == ok else None)


def detect(root: str | Path = "/", gpu: Callable[[], GpuInfo | None] = probe_gpu,
           cpu_arch: str | None = None,
           trt: Callable[[], str | None] = tensorrt_version, dists: DistVersion | None = None) -> DeviceInfo:
    """`gpu`, `trt` and `dists` (installed package versions) are what the running software says;
    tests pass doubles for them along with a fixture `root`."""
    dists = dists or _dist_version
    root = Path(root)
    model = (_read(root, "proc/device-tree/model") or "").strip("\x00\n ") or None
    compatible = [c for c in (_read(root, "proc/device-tree/compatible") or "").split("\x00") if c]
    soc, table_sm = sm_for_soc(compatible)
    g = gpu()
    sm, source = (g.sm, "gpu") if g else (table_sm, "soc-table" if table_sm else None)
    cuda, cuda_source = (g.cuda_runtime, "cudart") if g and g.cuda_runtime else _cuda_from_tree(root, dists)
    if cuda is None and g and g.cuda_driver:
        cuda, cuda_source = g.cuda_driver, "driver"
    return DeviceInfo(cpu_arch=cpu_arch or platform.machine(), jetson_model=model if soc else None,
                      soc=soc, l4t_release=_l4t(_read(root, "etc/nv_tegra_release")), sm=sm,
                      sm_source=source, cuda=cuda, tensorrt=trt(),
                      onnxruntime=dists(("onnxruntime", "onnxruntime-gpu")),
                      gpu_name=g.name if g else None, cuda_source=cuda_source,
                      cuda_driver=g.cuda_driver if g else None)
