"""The GPU device policy of a unit: which device nodes CUDA opens, by platform, and the
privileged oneshot that loads nvidia-uvm before the sandboxed service starts.

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
  CUDA_ERROR_NOT_SUPPORTED, 801). The set is the one Ghaf enumerates for CUDA on r36
  (tiiuae/ghaf, modules/microvm/sysvms/gpuvm-container-runtime.nix: "Hardware-enumerated set on
  JetPack r36. libcuda also needs the DRM render node and host1x fence for initialization").
- JetPack 7 (L4T r38 and later: Thor, and Orin on the OpenRM driver): Jetson software aligned
  with SBSA servers (NVIDIA's JetPack 7.0 release notes), so CUDA opens the nodes of NVIDIA's
  server driver: /dev/nvidiactl, /dev/nvidia0.., /dev/nvidia-uvm(-tools), /dev/nvidia-modeset.
- A dGPU host: the same driver's nodes (the CUDA installation guide's "Device Node Verification"),
  with the driver classes for every /dev/nvidiaN and /dev/nvidia-caps/* (MIG).

`platform_policy(root)` decides from the device's tree (`edge units print --root`, `install
--prefix`) and adds every GPU node present under its dev/, so the unit names what the device has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GPU_DEVICES", "GPU_DEVICE_CLASSES", "GPU_NODE_GLOBS", "GpuPolicy", "NVIDIA_MODPROBE", "UVM_UNIT",
           "platform_policy", "render_uvm"]

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
JETSON_JP6_DEVICES = [  # L4T r36 (JetPack 6): out-of-tree nvgpu, the iGPU under /dev/nvgpu/igpu0
    "/dev/nvmap", "/dev/host1x-fence", *(f"/dev/nvgpu/igpu0/{n}" for n in _IGPU),
    *(f"/dev/nvhost-{n}" for n in _NVHOST_GPU),
]
# The render node's minor is not fixed (renderD128, or renderD129 beside a display controller):
# these, where the device's tree shows none, and every renderD* it shows.
RENDER_NODES = [f"/dev/dri/renderD{n}" for n in range(128, 132)]
NVIDIA_DEVICES = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                  "/dev/nvidia-modeset"]
JETSON_JP7_DEVICES = NVIDIA_DEVICES  # L4T r38+ (JetPack 7): the SBSA driver's nodes
DGPU_DEVICES = NVIDIA_DEVICES
# Driver names in /proc/devices: "nvidia-frontend" (older drivers) or "nvidia"/"nvidiactl"/
# "nvidia-modeset" (R470+) for major 195, "nvidia-uvm", "nvidia-caps" (MIG); "nvgpu"/"nvhost"
# where the Jetson kernel registers its GPU nodes under those names. A name not in /proc/devices
# allows nothing.
NVIDIA_CLASSES = ["char-nvidia-frontend", "char-nvidia", "char-nvidiactl", "char-nvidia-modeset",
                  "char-nvidia-uvm", "char-nvidia-caps"]
JETSON_CLASSES = ["char-nvgpu", "char-nvhost"]
GPU_DEVICE_CLASSES = NVIDIA_CLASSES + JETSON_CLASSES
GPU_DEVICES = list(dict.fromkeys(JETSON_JP5_DEVICES + JETSON_JP6_DEVICES + RENDER_NODES + NVIDIA_DEVICES))
# GPU nodes CUDA may open on any platform (globs under /dev): what a device's tree is scanned for
GPU_NODE_GLOBS = ("nvidia*", "nvidia-caps/*", "nvgpu/igpu0/*", "nvhost-*", "nvmap", "host1x-fence", "dri/renderD*")
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


def platform_policy(root: str | Path = "/") -> GpuPolicy:
    """The device policy for the GPU platform of the tree at `root`: its platform's nodes, every
    GPU node present under its dev/, and the classes of its driver; every platform's where the
    tree says none (the shipped unit)."""
    root = Path(root)
    present = present_nodes(root)
    modprobe = NVIDIA_MODPROBE if (root / NVIDIA_MODPROBE.lstrip("/")).is_file() else None
    l4t = _l4t_major(root)
    renders = [n for n in present if n.startswith("/dev/dri/renderD")] or RENDER_NODES
    if l4t is not None and l4t >= 38:
        return GpuPolicy("jetpack7", _merge(JETSON_JP7_DEVICES, present, NVIDIA_CLASSES), modprobe)
    if l4t is not None and l4t >= 36:
        return GpuPolicy("jetpack6", _merge(JETSON_JP6_DEVICES + renders, present, JETSON_CLASSES))
    if l4t is not None:
        return GpuPolicy("jetpack5", _merge(JETSON_JP5_DEVICES, present, JETSON_CLASSES))
    if modprobe or (root / "proc" / "driver" / "nvidia").exists() or any("/nvidia" in n for n in present):
        return GpuPolicy("dgpu", _merge(DGPU_DEVICES, present, NVIDIA_CLASSES), modprobe)
    return GpuPolicy("any", tuple(GPU_DEVICES + GPU_DEVICE_CLASSES), modprobe)


def _merge(nodes: list[str], present: list[str], classes: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*nodes, *present, *classes]))


def render_uvm(modprobe: str) -> str:
    """The oneshot that loads nvidia-uvm and makes /dev/nvidia-uvm and /dev/nvidia0 before
    edge.service starts: outside edge's device policy, and done before systemd resolves
    edge.service's `char-nvidia-uvm` (at its start, from /proc/devices, which lists the driver
    only once it is loaded). A failure does not stop edge: its start then names CUDA's error."""
    return "\n".join([
        "[Unit]", "Description=nvidia-uvm and the NVIDIA device nodes, made before edge.service starts",
        "Before=edge.service", f"ConditionPathExists={modprobe}", "", "[Service]", "Type=oneshot",
        "RemainAfterExit=yes", f"ExecStart=-{modprobe} -u -c=0", ""])
