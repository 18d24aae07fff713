"""The GPU device policy of a unit: which device nodes CUDA opens, by platform, and the
privileged oneshot that makes the NVIDIA driver's nodes before the sandboxed service starts.

DeviceAllow= takes a node path (systemd stat()s it when the service starts; a node the device
lacks allows nothing) or `char-<name>` with a driver name from /proc/devices, which covers every
minor the driver has then (nvidia0..N). Misc-class nodes (/dev/nvmap: major 10 "misc") can only
be named by path: `char-misc` would allow every misc device; likewise `char-drm` would allow the
display's KMS nodes (/dev/dri/card*) with the render nodes, so render nodes are named by path.

Where each platform's list comes from:
- JetPack 5 (L4T r35): nvgpu built into the kernel, its nodes flat under /dev (/dev/nvhost-*-gpu)
  and /dev/nvmap, the memory allocator every CUDA allocation goes through.
- JetPack 6 (L4T r36): the out-of-tree nvgpu; the iGPU's nodes under /dev/nvgpu/igpu0, the
  /dev/nvhost-*-gpu nodes it still creates, /dev/nvmap (without it CUDA fails with
  "NvRmMemInitNvmap failed ... NvRmMemMgrInit failed", jetson-containers issue 384 on r36.2),
  /dev/host1x-fence and the GPU's DRM render node (without /dev/dri/renderD* cuInit returns
  CUDA_ERROR_NOT_SUPPORTED, 801). The set Ghaf enumerates for CUDA on r36 (tiiuae/ghaf,
  modules/microvm/sysvms/gpuvm-container-runtime.nix: "Hardware-enumerated set on JetPack r36.
  libcuda also needs the DRM render node and host1x fence for initialization"), and NVIDIA's r36
  list (the CDI spec nvidia-ctk generates, lf-edge/eve pkg/nvidia/cdi/jp6/jetson-orin.yaml), which
  also has nvidia.ko's /dev/nvidiactl, /dev/nvidia0 and /dev/nvidia-modeset: allowed too (see
  R36_NVIDIA_DEVICES).
- JetPack 7 (L4T r38 and later: Thor, and Orin on the OpenRM driver): Jetson software aligned
  with SBSA servers (NVIDIA's JetPack 7.0 release notes); NVIDIA's r38 list for Thor
  (pkg/nvidia/cdi/jp7/jetson-thor.yaml there): the server driver's /dev/nvidiactl, /dev/nvidia0,
  /dev/nvidia1, /dev/nvidia-uvm(-tools), /dev/nvidia-modeset, and /dev/nvmap, /dev/host1x-fence,
  /dev/dri/renderD128..130. JetPack 7.2's /dev/nvgpu/igpu-<PCI address>/* is allowed where the
  device's tree has it (the address is not known from an image).
- A dGPU host: the same driver's nodes (the CUDA installation guide's "Device Node Verification"),
  with the driver classes for every /dev/nvidiaN and /dev/nvidia-caps/* (MIG), and /dev/nvidiaN
  of every GPU the driver has bound (/proc/driver/nvidia/gpus/*/information).

`platform_policy(root)` decides from the device's tree (`edge units print --root`, `install
--prefix`) and adds every GPU node present under its dev/, so the unit names what the device has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GPU_DEVICES", "GPU_DEVICE_CLASSES", "GPU_NODE_GLOBS", "GpuPolicy", "NVIDIA_MODPROBE", "UVM_UNIT",
           "nvidia_minors", "platform_policy", "render_uvm"]

JETSON_JP5_DEVICES = [  # L4T r35 (JetPack 5): nvgpu built in, nodes flat under /dev
    "/dev/nvmap", "/dev/nvhost-ctrl", "/dev/nvhost-ctrl-gpu", "/dev/nvhost-prof-gpu",
    "/dev/nvhost-gpu", "/dev/nvhost-as-gpu", "/dev/nvhost-dbg-gpu", "/dev/nvhost-tsg-gpu",
    "/dev/nvhost-sched-gpu", "/dev/nvhost-power-gpu", "/dev/nvhost-nvsched-gpu", "/dev/nvhost-ctxsw-gpu",
    "/dev/nvhost-ctrl-nvdla0", "/dev/nvhost-ctrl-nvdla1", "/dev/nvhost-nvdla0", "/dev/nvhost-nvdla1",
]
_IGPU = ("ctrl", "as", "channel", "tsg", "dbg", "prof", "prof-ctx", "prof-dev", "sched", "power", "ctxsw",
         "nvsched", "nvsched_ctrl_fifo")
_NVHOST_GPU = ("ctrl-gpu", "as-gpu", "gpu", "tsg-gpu", "dbg-gpu", "prof-gpu", "prof-ctx-gpu", "prof-dev-gpu",
               "sched-gpu", "power-gpu", "ctxsw-gpu", "nvsched-gpu", "nvsched_ctrl_fifo-gpu")
# nvidia.ko's nodes, which NVIDIA's r36 list gives every CUDA container beside nvgpu's: on r36
# nvidia.ko is the display driver, so CUDA is not known to open them; they are allowed so that a
# unit rendered from an image agrees with `edge doctor` on a device where the driver is loaded.
R36_NVIDIA_DEVICES = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-modeset"]
JETSON_JP6_DEVICES = [  # L4T r36 (JetPack 6): out-of-tree nvgpu, the iGPU under /dev/nvgpu/igpu0
    "/dev/nvmap", "/dev/host1x-fence", *(f"/dev/nvgpu/igpu0/{n}" for n in _IGPU),
    *(f"/dev/nvhost-{n}" for n in _NVHOST_GPU), *R36_NVIDIA_DEVICES,
]
# The render node's minor is not fixed (renderD128, or renderD129 beside a display controller;
# NVIDIA's r38 list for Thor has renderD128..130): these, where the device's tree shows none, and
# every renderD* it shows.
RENDER_NODES = [f"/dev/dri/renderD{n}" for n in range(128, 132)]
NVIDIA_DEVICES = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                  "/dev/nvidia-modeset"]
# L4T r38+ (JetPack 7): the OpenRM driver's nodes and the Tegra ones NVIDIA's r38 list for Thor
# still has (lf-edge/eve pkg/nvidia/cdi/jp7/jetson-thor.yaml): nvmap, host1x-fence, a second
# /dev/nvidia1; its display (fb0, dri/card*), PVA (nvhost-ctrl-pva0) and NvSciIpc (nvsciipc)
# nodes are left out, as they are on r36: no CUDA path opens them.
JETSON_JP7_DEVICES = [*NVIDIA_DEVICES, "/dev/nvidia1", "/dev/nvmap", "/dev/host1x-fence"]
DGPU_DEVICES = NVIDIA_DEVICES
# Driver names in /proc/devices: "nvidia-frontend" (older drivers) or "nvidia"/"nvidiactl"/
# "nvidia-modeset" (R470+) for major 195, "nvidia-uvm", "nvidia-caps" (MIG); "nvgpu"/"nvhost"
# where the Jetson kernel registers its GPU nodes under those names. A name not in /proc/devices
# allows nothing.
NVIDIA_CLASSES = ["char-nvidia-frontend", "char-nvidia", "char-nvidiactl", "char-nvidia-modeset",
                  "char-nvidia-uvm", "char-nvidia-caps"]
JETSON_CLASSES = ["char-nvgpu", "char-nvhost"]
GPU_DEVICE_CLASSES = NVIDIA_CLASSES + JETSON_CLASSES
GPU_DEVICES = list(dict.fromkeys(JETSON_JP5_DEVICES + JETSON_JP6_DEVICES + RENDER_NODES + JETSON_JP7_DEVICES))
# GPU nodes CUDA may open on any platform (globs under /dev): what a device's tree is scanned for,
# by `edge units` and by `edge doctor` alike. nvgpu/igpu*/*: r36's igpu0 and JetPack 7.2's
# igpu-<PCI address> (/dev/nvgpu/igpu-0000:01:00.0/*); nvhost-: the GPU's and DLA's nodes only
# (Thor's nvhost-ctrl-pva0 is the PVA's).
GPU_NODE_GLOBS = ("nvidia*", "nvidia-caps/*", "nvgpu/igpu*/*", "nvhost-ctrl", "nvhost-*gpu", "nvhost-*nvdla*",
                  "nvmap", "host1x-fence", "dri/renderD*")
# nvidia-uvm and /dev/nvidiaN are often made on first use by the setuid nvidia-modprobe, which
# the sandboxed service may not run (NoNewPrivileges=, an empty bounding set), and which its
# cgroup's device policy would refuse even as ExecStartPre=+ (systemd applies DeviceAllow= to the
# whole cgroup: systemd issue 26035): a oneshot unit outside the policy runs it first.
NVIDIA_MODPROBE = "/usr/bin/nvidia-modprobe"
UVM_UNIT = "edge-nvidia-uvm.service"


@dataclass(frozen=True)
class GpuPolicy:
    """The DeviceAllow= entries of one device, and the nvidia-modprobe its oneshot runs (or None)."""

    platform: str  # jetpack5 | jetpack6 | jetpack7 | dgpu | any
    devices: tuple[str, ...]
    modprobe: str | None = None


def _l4t_major(root: Path) -> int | None:
    """The L4T major release (35, 36, 38) of the tree, None when it is no Jetson; an unreadable
    release line is taken as JetPack 6 (the current one)."""
    try:
        release = (root / "etc" / "nv_tegra_release").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"R(\d+)\s*\(release\)", release)
    return int(m.group(1)) if m else 36


def present_nodes(root: Path) -> list[str]:
    """Every GPU node under <root>/dev, as /dev/... paths."""
    dev = root / "dev"
    found = {f"/dev/{p.relative_to(dev)}" for g in GPU_NODE_GLOBS for p in dev.glob(g) if not p.is_dir()}
    return sorted(found)


def driver_gpu_nodes(root: Path) -> list[str]:
    """/dev/nvidiaN of every GPU NVIDIA's driver has bound (the "Device Minor:" line of each
    <root>/proc/driver/nvidia/gpus/<bus id>/information), whether or not its node exists yet."""
    found = []
    for info in sorted((root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information")):
        try:
            m = re.search(r"^Device Minor:\s*(\d+)", info.read_text(errors="replace"), re.M)
        except OSError:
            continue
        if m:
            found.append(f"/dev/nvidia{int(m.group(1))}")
    return found


def platform_policy(root: str | Path = "/") -> GpuPolicy:
    """The device policy for the GPU platform of the tree at `root`: its platform's nodes, every
    GPU node present under its dev/, and the classes of its driver; every platform's where the
    tree says none (the shipped unit). From a live tree (a dev/ with nodes in it) a Jetson node the
    device lacks is left out: the kernel makes those at boot, so one missing at install is missing
    at start too, and older systemd logs a warning for each missing path at every start (newer
    ones skip it at debug level). The /dev/nvidia* nodes stay: nvidia-modprobe, udev or
    nvidia-persistenced make them on demand, after the install."""
    root = Path(root)
    present = present_nodes(root)
    modprobe = NVIDIA_MODPROBE if (root / NVIDIA_MODPROBE.lstrip("/")).is_file() else None
    l4t = _l4t_major(root)
    renders = [n for n in present if n.startswith("/dev/dri/renderD")] or RENDER_NODES
    if l4t is not None and l4t >= 38:
        platform, nodes, classes = "jetpack7", JETSON_JP7_DEVICES + renders, NVIDIA_CLASSES
    elif l4t is not None and l4t >= 36:
        platform, nodes, classes = "jetpack6", JETSON_JP6_DEVICES + renders, JETSON_CLASSES
    elif l4t is not None:
        platform, nodes, classes = "jetpack5", JETSON_JP5_DEVICES, JETSON_CLASSES
    elif modprobe or (root / "proc" / "driver" / "nvidia").exists() or any("/nvidia" in n for n in present):
        platform, nodes, classes = "dgpu", DGPU_DEVICES + driver_gpu_nodes(root), NVIDIA_CLASSES
    else:
        platform, nodes, classes = "any", GPU_DEVICES, GPU_DEVICE_CLASSES
    if _live(root):  # "any" there: a device without a GPU platform has no GPU node to wait for
        nodes = [n for n in nodes if n in present or (n.startswith("/dev/nvidia") and platform != "any")]
    return GpuPolicy(platform, _merge(nodes, present, classes), modprobe)


def _live(root: Path) -> bool:
    """A running system's tree (or a copy with its nodes), not an image: its dev/ has entries."""
    try:
        return any((root / "dev").iterdir())
    except OSError:
        return False


def _merge(nodes: list[str], present: list[str], classes: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*nodes, *present, *classes]))


# What nvidia-modprobe makes for each option (nvidia-modprobe.c, modprobe-utils): `-c=N` loads
# nvidia.ko and makes /dev/nvidiaN (char 195:N), N = 255 being /dev/nvidiactl; `-u -c=N` loads
# nvidia-uvm instead and makes /dev/nvidia-uvm and /dev/nvidia-uvm-tools (minors N and N+1 of
# nvidia-uvm's major in /proc/devices), never a /dev/nvidiaN: the two are separate invocations.
NVIDIACTL_MINOR = 255


def nvidia_minors(devices: tuple[str, ...] | list[str] | None) -> tuple[int, ...]:
    """The N of every /dev/nvidiaN a policy allows (0 when it names none): the GPUs the oneshot
    makes nodes for."""
    found = sorted({int(m.group(1)) for d in devices or () if (m := re.fullmatch(r"/dev/nvidia(\d+)", d))})
    return tuple(found) or (0,)


def render_uvm(modprobe: str, minors: tuple[int, ...] = (0,)) -> str:
    """The oneshot that makes every node CUDA opens on NVIDIA's server driver before edge.service
    starts: /dev/nvidiactl, /dev/nvidiaN for each GPU in `minors` (loading nvidia.ko), then
    nvidia-uvm with /dev/nvidia-uvm and /dev/nvidia-uvm-tools. It runs outside edge's device
    policy (the sandboxed service can make no node), and before systemd resolves edge.service's
    `char-nvidia-uvm` (at its start, from /proc/devices, which lists the driver only once it is
    loaded). /dev/nvidia-modeset (`-m`) is left to the display stack: CUDA does not open it. Each
    command's failure is ignored: edge's start then names CUDA's error."""
    runs = [f"-c={NVIDIACTL_MINOR}", *(f"-c={n}" for n in minors), "-u -c=0"]
    return "\n".join([
        "[Unit]", "Description=NVIDIA device nodes (nvidiactl, nvidiaN, nvidia-uvm) made before edge.service starts",
        "Before=edge.service", f"ConditionPathExists={modprobe}", "", "[Service]", "Type=oneshot",
        "RemainAfterExit=yes", *(f"ExecStart=-{modprobe} {r}" for r in runs), ""])
