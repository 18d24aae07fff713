"""What this machine is: Jetson module and L4T release, GPU (name, SM arch), CUDA, TensorRT, ONNX Runtime, CPU.

Every file read takes a `root`, so tests run detection over fixture trees of real Orin (JetPack 5
and 6), Xavier, Nano, dGPU and pip-assembled CUDA layouts. Two things are asked of the running
software rather than of files, and both are parameters so tests pass doubles at that boundary:
the GPU (`probe_gpu`, through cuda-python's driver API only: the driver's own CUDA version, the
device's name, SM arch, whether it is integrated, its memory, or why none could be used) and the
TensorRT module that would deserialize an engine (`tensorrt_version`, read from the module
without importing it).

A Jetson is its module (`jetson_module`: the device tree's `compatible` entry for the
system-on-module, e.g. `p3767-0005`), not its board: the carrier board's model string (a
devkit's "…Developer Kit Super", a vendor's carrier) is kept as a label (`jetson_model`,
`board`) and changes nothing an engine depends on.

CUDA numbers and where each comes from: `cuda_driver` is what the driver supports
(cuDriverGetVersion); `cuda_runtimes` lists every CUDA runtime the process could load (the
toolkit's /usr/local/cuda that JetPack's TensorRT links, the nvidia-cuda-runtime wheel a
TensorRT wheel preloads), each with its source; `cuda` (the engine key's CUDA major) is the
runtime TensorRT links (`_linked_runtime`): a `tensorrt-cuNN` wheel's CUDA NN, else the
toolkit's, else the first runtime found, else the driver's; `cuda_source` says which.
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

from edge.device.memory import unified

__all__ = ["DeviceInfo", "assigned_version", "GpuInfo", "GpuProbe", "SOC_SM", "cpu_flags", "detect", "module_of", "probe_gpu",
           "sm_for_soc", "tensorrt_version", "slug", "version_tuple"]

# Jetson SoC (device-tree "compatible") -> SM arch of its integrated GPU
SOC_SM = {"tegra264": "sm_110", "tegra234": "sm_87", "tegra194": "sm_72", "tegra186": "sm_62",
          "tegra210": "sm_53"}
# pip-assembled CUDA runtime: the wheel a TensorRT wheel depends on and preloads
CUDART_DISTS = ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime")
# TensorRT wheels name the CUDA major they link (and whose nvidia-cuda-runtime-cuNN they preload)
TRT_WHEEL_CUDA = ("13", "12", "11")
TRT_WHEEL_PARTS = ("tensorrt-cu{}", "tensorrt-cu{}-bindings", "tensorrt-cu{}-libs", "tensorrt-lean-cu{}",
                   "tensorrt-lean-cu{}-bindings", "tensorrt-lean-cu{}-libs")
# a Jetson module's part number in the device tree's compatible ("nvidia,p3767-0005")
MODULE = re.compile(r"p\d{4}-\d{4}")
# the module an engine is deserialized with -> the distributions that may carry it
TRT_MODULES = {"tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-bindings",
                            "tensorrt-cu12-bindings"),
               "tensorrt_lean": ("tensorrt-lean", "tensorrt-lean-cu13", "tensorrt-lean-cu12",
                                 "tensorrt-lean-cu13-bindings", "tensorrt-lean-cu12-bindings")}


@dataclass(frozen=True)
class GpuInfo:
    """GPU 0 as the CUDA driver reports it."""

    name: str  # "Orin", "NVIDIA H100 80GB HBM3", ...
    sm: str  # sm_87
    integrated: bool = False  # shares the CPU's DRAM (every Jetson)
    total_bytes: int | None = None


@dataclass(frozen=True)
class GpuProbe:
    """What the driver said: the GPU, the driver's CUDA version (known even when cuInit fails),
    and, when there is no usable GPU, why (one line)."""

    gpu: GpuInfo | None
    driver: str | None = None  # MAJ.MIN (cuDriverGetVersion)
    error: str | None = None


@dataclass(frozen=True)
class DeviceInfo:
    cpu_arch: str
    jetson_model: str | None  # the board's model string: a label, never part of a key
    soc: str | None
    l4t_release: str | None
    sm: str | None
    sm_source: str | None  # "gpu" (queried) | "soc-table" | None
    cuda: str | None  # MAJ.MIN: the engine key's CUDA (its major)
    tensorrt: str | None  # the module's own __version__, build number included where it has one
    onnxruntime: str | None
    gpu_name: str | None = None
    cuda_source: str | None = None  # where `cuda` came from: a runtime's source, or "driver"
    cuda_driver: str | None = None  # MAJ.MIN the driver supports (cuDriverGetVersion)
    cuda_runtimes: tuple[tuple[str, str], ...] = ()  # (MAJ.MIN, where) of each runtime found
    gpu_integrated: bool | None = None  # unified memory (a Jetson's iGPU)
    gpu_total_bytes: int | None = None
    gpu_error: str | None = None  # why no GPU could be used, as the driver said
    jetson_module: str | None = None  # the system-on-module's part number, from the device tree

    @property
    def platform(self) -> str | None:
        """What an engine's tactics were timed on beyond the SM arch: Orin AGX, NX and Nano all
        report sm_87 (and "Orin"), with different SM counts and memory; so a Jetson is its module
        (`jetson-p3767-0005`: its GPU configuration, whatever carrier board or power mode), a
        dGPU its CPU arch and product name (plans are not portable across host platforms: an
        H100 PCIe in an x86 and in an aarch64 server are two platforms). A Jetson whose device
        tree names no module is its board."""
        if self.jetson_module and self.jetson_gpu:
            return f"jetson-{self.jetson_module}"
        if self.jetson_model and self.jetson_gpu:
            return self.board
        return slug(f"{self.cpu_arch} {self.gpu_name}") if self.gpu_name else None

    @property
    def board(self) -> str | None:
        """The carrier board as a slug of its model string: a report label, and what engine keys
        named before they named the module (edge.engines.key accepts those on the same board)."""
        if not self.jetson_model:
            return None
        return slug(self.jetson_model.replace("NVIDIA ", "").replace(" Developer Kit", ""))

    @property
    def jetson(self) -> bool:
        return bool(self.soc or self.l4t_release)

    @property
    def jetson_gpu(self) -> bool:
        """GPU 0 is the Jetson's own iGPU: a Jetson whose driver does not call GPU 0 discrete (an
        IGX board with a dGPU as device 0 is a dGPU host for its engines and its memory)."""
        return self.jetson and self.gpu_integrated is not False

    @property
    def unified_memory(self) -> bool:
        """The GPU's buffers are the CPU's DRAM, by edge.device.memory.unified's one rule."""
        return unified(self.gpu_integrated, self.jetson)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cuda_runtimes"] = [{"version": v, "source": w} for v, w in self.cuda_runtimes]
        return {**d, "platform": self.platform, "board": self.board, "unified_memory": self.unified_memory}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(errors="replace")
    except OSError:
        return None


def module_of(compatible: list[str]) -> str | None:
    """The system-on-module's part number from the device tree's compatible list: its own entry
    ("nvidia,p3701-0005"), else the module half of a "carrier+module" entry
    ("nvidia,p3509-0000+p3668-0001" on a Xavier NX, which lists no module entry)."""
    for entry in compatible:
        name = entry.split(",")[-1]
        if MODULE.fullmatch(name):
            return name
    for entry in compatible:
        if "+" in entry:
            m = MODULE.match(entry.split("+", 1)[1])
            if m:
                return m.group(0)
    return None


def cpu_flags(root: str | Path = "/") -> frozenset[str]:
    """The CPU's features as the kernel lists them in /proc/cpuinfo: x86's `flags` (avx2,
    amx_tile, hypervisor, ...), ARM's `Features` (asimd, asimddp, i8mm, ...)."""
    for line in (_read(Path(root), "proc/cpuinfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


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


def version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in (version or "").split("."))


def _cuda_runtimes(root: Path, dists: DistVersion) -> list[tuple[str, str]]:
    """Each CUDA runtime the process could load, from files and installed packages: the
    toolkit's (what JetPack's TensorRT links) and the pip wheel (what a TensorRT wheel preloads).
    Absent files are normal (runtime-only and pip-assembled installs), never an error."""
    found = []
    text = _read(root, "usr/local/cuda/version.json")
    if text:
        try:
            found.append((".".join(json.loads(text)["cuda"]["version"].split(".")[:2]),
                          "/usr/local/cuda/version.json"))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    m = re.search(r"CUDA Version (\d+)\.(\d+)", _read(root, "usr/local/cuda/version.txt") or "")
    if m and not found:
        found.append((f"{m.group(1)}.{m.group(2)}", "/usr/local/cuda/version.txt"))
    for name in CUDART_DISTS:
        v = dists((name,))
        if v:
            found.append((".".join(v.split(".")[:2]), f"pip {name} {v}"))
    return found


def _linked_runtime(runtimes: list[tuple[str, str]], dists: DistVersion) -> tuple[str, str] | None:
    """The CUDA runtime TensorRT links, among those found: a `tensorrt-cuNN` wheel links CUDA NN
    (the nvidia-cuda-runtime-cuNN wheel it preloads, else NN itself); JetPack's TensorRT and the
    deb/tar installs link the toolkit's (/usr/local/cuda); else the first found."""
    for major in TRT_WHEEL_CUDA:
        wheel = next((name for name in (p.format(major) for p in TRT_WHEEL_PARTS) if dists((name,))), None)
        if wheel:
            pip = next((r for r in runtimes if r[1].startswith(f"pip nvidia-cuda-runtime-cu{major} ")), None)
            return pip or (major, f"pip {wheel} {dists((wheel,))} (links CUDA {major})")
    toolkit = next((r for r in runtimes if r[1].startswith("/usr/local/cuda")), None)
    return toolkit or (runtimes[0] if runtimes else None)


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_version(module: str) -> str | None:
    """`__version__` of an importable module, read from its __init__.py without importing it
    (None when it is not installed or the file does not assign a literal)."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return str(getattr(loaded, "__version__", "")) or None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None
    return assigned_version(Path(spec.origin)) or _dist_version(TRT_MODULES.get(module, ()))


def assigned_version(path: Path) -> str | None:
    """The string a Python file assigns to `__version__` at its top level, read without running it
    (None: the file is unreadable, or assigns no literal)."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return None


def tensorrt_version() -> str | None:
    """The version of the module an engine would be deserialized with: `tensorrt` (JetPack's
    system package, or a wheel), else the lean runtime `tensorrt_lean` — the order
    edge.engines.trt_session imports them in."""
    for module in TRT_MODULES:
        try:
            present = module in sys.modules or importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            present = False
        if present:
            return _module_version(module)
    return None


def _maj_min(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # 12060 -> 12.6


def probe_gpu(driver: Any = None, work: bool = False) -> GpuProbe:
    """GPU 0 through cuda-python's driver API (`driver`: the module, or a test double); a probe
    with no GPU and the reason where there is no cuda-python, driver library or usable device.
    `work`: go as far as a service's first CUDA work (edge.device.cuda.first_work: the primary
    context retained and one byte allocated), which needs device nodes cuInit does not."""
    from edge.device.cuda import CudaApi, driver_module, first_work
    from edge.errors import EdgeError

    try:
        api = CudaApi(driver or driver_module())
    except EdgeError as exc:  # MissingDependency: cuda-python
        return GpuProbe(None, None, str(exc))
    version = None
    try:
        version = _maj_min(api.call("cuDriverGetVersion"))  # needs no cuInit
        api.call("cuInit", 0)
        dev = api.call("cuDeviceGet", 0)
        attr = api.driver.CUdevice_attribute
        major = api.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = api.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        integrated = api.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_INTEGRATED, dev)
        raw = api.call("cuDeviceGetName", 256, dev)
        total = api.call("cuDeviceTotalMem", dev)
        if work:
            first_work(api)
    except EdgeError as exc:
        return GpuProbe(None, version, str(exc))
    name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
    return GpuProbe(GpuInfo(name=name, sm=f"sm_{major}{minor}", integrated=bool(integrated),
                            total_bytes=int(total)), version)


def detect(root: str | Path = "/", gpu: Callable[[], GpuProbe] = probe_gpu,
           cpu_arch: str | None = None,
           trt: Callable[[], str | None] = tensorrt_version, dists: DistVersion | None = None) -> DeviceInfo:
    """`gpu`, `trt` and `dists` (installed package versions) are what the running software says;
    tests pass doubles for them along with a fixture `root`."""
    dists = dists or _dist_version
    root = Path(root)
    model = (_read(root, "proc/device-tree/model") or "").strip("\x00\n ") or None
    compatible = [c for c in (_read(root, "proc/device-tree/compatible") or "").split("\x00") if c]
    soc, table_sm = sm_for_soc(compatible)
    probe = gpu()
    g = probe.gpu
    sm, source = (g.sm, "gpu") if g else (table_sm, "soc-table" if table_sm else None)
    runtimes = _cuda_runtimes(root, dists)
    cuda, cuda_source = _linked_runtime(runtimes, dists) or (probe.driver, "driver" if probe.driver else None)
    return DeviceInfo(cpu_arch=cpu_arch or platform.machine(), jetson_model=model if soc else None,
                      soc=soc, l4t_release=_l4t(_read(root, "etc/nv_tegra_release")), sm=sm,
                      sm_source=source, cuda=cuda, tensorrt=trt(),
                      onnxruntime=dists(("onnxruntime", "onnxruntime-gpu")),
                      gpu_name=g.name if g else None, cuda_source=cuda_source, cuda_driver=probe.driver,
                      cuda_runtimes=tuple(runtimes), gpu_integrated=g.integrated if g else None,
                      gpu_total_bytes=g.total_bytes if g else None, gpu_error=probe.error,
                      jetson_module=module_of(compatible) if soc else None)
