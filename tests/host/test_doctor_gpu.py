"""edge doctor's GPU checks over fixture devices and fake /dev trees: where each CUDA number came
from, a runtime newer than the driver, llama.cpp's offload, and the unit's device policy."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edge.config import parse_config
from edge.device.identity import GpuInfo, GpuProbe, detect
from edge.host.doctor_gpu import (PROBE, cuda_runtime_check, device_check, gpu_offload_checks, probe_command,
                                  unit_device_checks)
from edge.host.gpu_nodes import platform_policy
from edge.host.units import UnitOptions, render_service

FIX = Path(__file__).parents[1] / "fixtures" / "devices"
ORIN = GpuProbe(GpuInfo("Orin", "sm_87", integrated=True), "12.6")


def dists_of(versions: dict[str, str]):
    return lambda names: next((versions[n] for n in names if n in versions), None)  # test double: pip


def test_a_newer_pip_runtime_on_a_jetson_fails_naming_the_fix() -> None:
    d = detect(FIX / "orin-nano-jp6", gpu=lambda: ORIN, trt=lambda: "10.3.0",
               dists=dists_of({"nvidia-cuda-runtime-cu12": "12.9.79"}))
    name, level, msg, fix = cuda_runtime_check(d)
    assert level == "fail" and "12.9 (pip nvidia-cuda-runtime-cu12 12.9.79) is newer than the driver's CUDA 12.6" in msg
    assert "no forward compatibility" in msg and "nvidia-cuda-runtime-cu12==12.6.*" in fix
    _, _, text, _ = device_check(d, "cuda")
    assert "CUDA driver 12.6 (cuDriverGetVersion)" in text and "engine key CUDA 12.9 (from pip" in text
    same = detect(FIX / "orin-agx", gpu=lambda: ORIN, trt=lambda: "10.3.0", dists=dists_of({}))
    assert cuda_runtime_check(same)[1] == "ok"  # JetPack's own 12.6 toolkit


def test_a_dgpu_runs_a_newer_minor_but_not_a_newer_major() -> None:
    h100 = GpuProbe(GpuInfo("NVIDIA H100 80GB HBM3", "sm_90"), "12.6")
    minor = detect(FIX / "dgpu-pip-x86", gpu=lambda: h100, dists=dists_of({"nvidia-cuda-runtime-cu12": "12.9.79"}))
    assert cuda_runtime_check(minor)[1] == "ok"
    major = detect(FIX / "dgpu-x86", gpu=lambda: h100, dists=dists_of({}))  # toolkit 13.0, driver 12.6
    assert cuda_runtime_check(major)[1] == "fail"
    assert cuda_runtime_check(detect(FIX / "dgpu-x86", gpu=lambda: GpuProbe(None, None, "x"), dists=dists_of({}))) is None


def test_offload_on_a_cuda_build_whose_gpu_does_not_start_names_the_drivers_error() -> None:
    cfg = parse_config('[[models]]\nname = "m"\npath = "/m.gguf"\nn_gpu_layers = -1\n')
    closed = detect(FIX / "orin-nano-jp6", gpu=lambda: GpuProbe(None, "12.6", "CUDA cuInit failed: "
                                                                 "CUDA_ERROR_NOT_SUPPORTED (on JetPack 6 ...)"))
    (name, level, msg, fix), = gpu_offload_checks(cfg, closed, "cuda")
    assert level == "fail" and "CUDA build, but its CUDA device did not start" in msg and "NOT_SUPPORTED" in msg
    (_, level, msg, fix), = gpu_offload_checks(cfg, closed, "cpu")
    assert level == "fail" and "CPU-only build" in msg and "-DGGML_CUDA=on" in fix
    assert gpu_offload_checks(cfg, detect(FIX / "orin-agx", gpu=lambda: ORIN), "cuda")[0][1] == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes (mknod) needs root")
def test_a_unit_that_blocks_a_gpu_node_of_this_machine_fails_naming_it(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    for rel, major, minor in (("nvgpu/igpu0/ctrl", 508, 0), ("dri/renderD128", 226, 128), ("host1x-fence", 507, 0),
                              ("nvmap", 10, 125), ("nvhost-ctrl-gpu", 508, 1), ("dri/card0", 226, 0)):
        (dev / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(dev / rel, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    proc = tmp_path / "devices"
    proc.write_text("Character devices:\n 10 misc\n226 drm\n507 host1x-fence\n508 nvgpu\n\nBlock devices:\n  8 sd\n")
    jp6 = render_service(UnitOptions(devices=platform_policy(FIX / "orin-agx").devices))
    (_, level, msg, _), = unit_device_checks(jp6, dev, proc, probe=False)
    assert level == "ok" and "5 found" in msg  # the KMS node dri/card0 is not a GPU node
    # the JetPack 6 policy before: neither /dev/nvmap nor the legacy nvhost names (char-nvgpu: only
    # where the kernel registers that name); the render node through char-drm, now gone
    old = "DevicePolicy=closed\n" + "".join(f"DeviceAllow={d} rw\n" for d in (
        "/dev/nvgpu/igpu0/ctrl", "/dev/host1x-fence"))
    (_, level, msg, fix), = unit_device_checks(old, dev, proc, probe=False)
    assert level == "fail" and "blocks GPU nodes this machine has: /dev/dri/renderD128, /dev/nvhost-ctrl-gpu, " \
                                "/dev/nvmap" in msg
    assert "edge units install" in fix
    assert unit_device_checks(None, dev, proc) == []


def test_the_policy_probe_does_first_cuda_work_with_the_units_environment() -> None:
    """systemd-run with the unit's device policy, user, groups and Environment= (so that
    CUDA_VISIBLE_DEVICES counts); the probe retains the primary context and allocates one byte."""
    unit = ("DevicePolicy=closed\nDeviceAllow=/dev/nvmap rw\nDeviceAllow=char-nvgpu rw\nSupplementaryGroups=video render\n"
            "Environment=CUDA_CACHE_PATH=%C/edge/cuda\nEnvironment=CUDA_VISIBLE_DEVICES=1 \"OMP_NUM_THREADS=2\"\n")
    cmd = probe_command(unit, "/usr/bin/systemd-run")
    pairs = list(zip(cmd, cmd[1:]))
    for prop in ("DevicePolicy=closed", "DynamicUser=yes", "DeviceAllow=/dev/nvmap rw", "DeviceAllow=char-nvgpu rw",
                 "SupplementaryGroups=video render"):
        assert ("-p", prop) in pairs, prop
    assert ("-E", "CUDA_VISIBLE_DEVICES=1") in pairs and ("-E", "OMP_NUM_THREADS=2") in pairs
    assert not [v for k, v in pairs if k == "-E" and v.startswith("CUDA_CACHE_PATH")]  # a specifier: not expanded
    assert cmd[-1] == PROBE and "probe_gpu(work=True)" in PROBE


def test_the_probe_names_what_fails_after_cuinit() -> None:
    """JetPack 6 without /dev/nvmap: cuInit and the queries pass, the first allocation fails."""
    from edge.device.identity import probe_gpu
    from fakecuda import FakeGpu

    assert probe_gpu(FakeGpu().driver, work=True).gpu is not None
    nvmap_closed = FakeGpu(fail={"cuMemAlloc": "CUDA_ERROR_OUT_OF_MEMORY"})
    p = probe_gpu(nvmap_closed.driver, work=True)
    assert p.gpu is None and "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY" in p.error and nvmap_closed.retained == 0
    assert probe_gpu(FakeGpu(fail={"cuMemAlloc": "CUDA_ERROR_OUT_OF_MEMORY"}).driver).gpu is not None  # cuInit only


def _mknod_tree(dev: Path, nodes: tuple[tuple[str, int, int], ...]) -> None:
    for rel, major, minor in nodes:
        (dev / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(dev / rel, stat.S_IFCHR | 0o600, os.makedev(major, minor))


# Char devices as on the device (NVIDIA's r36 list for an Orin, its r38 list for Thor), with
# majors as their drivers register them; no /proc/devices: only paths can allow these.
ORIN_R36 = (("nvmap", 10, 125), ("host1x-fence", 507, 0), ("nvgpu/igpu0/ctrl", 508, 0), ("nvhost-ctrl-gpu", 508, 1),
            ("dri/renderD128", 226, 128), ("nvidiactl", 195, 255), ("nvidia0", 195, 0), ("nvidia-modeset", 195, 254),
            ("dri/card0", 226, 0), ("fb0", 29, 0), ("nvsciipc", 490, 0))
THOR_R38 = (("nvmap", 10, 125), ("host1x-fence", 507, 0), ("nvidiactl", 195, 255), ("nvidia0", 195, 0),
            ("nvidia1", 195, 1), ("nvidia-modeset", 195, 254), ("nvidia-uvm", 511, 0), ("nvidia-uvm-tools", 511, 1),
            ("dri/renderD128", 226, 128), ("dri/renderD129", 226, 129), ("dri/renderD130", 226, 130),
            ("dri/card1", 226, 1), ("fb0", 29, 0), ("nvsciipc", 490, 0), ("nvhost-ctrl-pva0", 492, 0))


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes (mknod) needs root")
@pytest.mark.parametrize("tree, nodes, gpu_nodes", [("orin-agx", ORIN_R36, 8), ("thor-jp7", THOR_R38, 11)])
def test_doctor_agrees_with_a_unit_rendered_from_the_devices_image(tmp_path: Path, tree: str, nodes, gpu_nodes) -> None:
    """The unit `edge units install --prefix <rootfs>` writes from an image (no dev/) allows every
    GPU node NVIDIA's list gives the running device, so doctor finds none blocked; the display,
    PVA and NvSciIpc nodes are no GPU nodes for either."""
    import shutil

    image = tmp_path / "rootfs"
    shutil.copytree(FIX / tree, image, ignore=shutil.ignore_patterns("dev", "proc"))
    _mknod_tree(tmp_path / "dev", nodes)
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia\n226 drm\n\nBlock devices:\n")
    unit = render_service(UnitOptions(devices=platform_policy(image).devices))
    (_, level, msg, _), = unit_device_checks(unit, tmp_path / "dev", tmp_path / "devices", probe=False)
    assert level == "ok" and f"({gpu_nodes} found)" in msg, msg
