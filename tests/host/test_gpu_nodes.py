"""The device policy per GPU platform and the oneshot that makes the NVIDIA driver's nodes, checked
against NVIDIA's own sources: nvidia-modprobe's options and the r36/r38 device lists."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from edge.host.gpu_nodes import NVIDIA_MODPROBE, nvidia_minors, platform_policy, present_nodes, render_uvm

FIX = Path(__file__).parents[1] / "fixtures" / "devices"

# What nvidia-modprobe makes, as its source says (NVIDIA/nvidia-modprobe: nvidia-modprobe.c's main,
# modprobe-utils/nvidia-modprobe-utils.{c,h}): without -u, each -c=N runs nvidia_mknod(N), whose
# assign_device_file_name names minor 255 (NV_CTL_DEVICE_NUM) /dev/nvidiactl and any other N
# /dev/nvidiaN; with -u it loads nvidia-uvm instead and each -c=N runs nvidia_uvm_mknod(N), which
# makes /dev/nvidia-uvm at minor N and /dev/nvidia-uvm-tools at N + 1, and no /dev/nvidiaN at all.
# The options it knows (option-table.h): anything else exits 1.
MODPROBE_OPTIONS = {"-v", "-h", "-c", "-u", "-m", "-s", "-l", "-f", "-a"}


def made_by(args: list[str]) -> set[str]:
    """The nodes one nvidia-modprobe command line makes, by the table above (the test's stand-in
    for running the setuid helper, which needs the driver)."""
    opts = {a.split("=", 1)[0] for a in args}
    assert opts <= MODPROBE_OPTIONS, f"nvidia-modprobe has no option {opts - MODPROBE_OPTIONS}"
    minors = [int(a.split("=", 1)[1]) for a in args if a.startswith("-c=")]
    if "-u" in opts:
        return {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} if 0 in minors else set()
    return {"/dev/nvidiactl" if n == 255 else f"/dev/nvidia{n}" for n in minors} | (
        {"/dev/nvidia-modeset"} if "-m" in opts else set())


def oneshot_makes(unit: str, modprobe: str = NVIDIA_MODPROBE) -> set[str]:
    made: set[str] = set()
    for line in re.findall(r"^ExecStart=-?(.+)$", unit, re.M):
        cmd = shlex.split(line)
        assert cmd[0] == modprobe
        made |= made_by(cmd[1:])
    return made


def test_the_table_reads_nvidia_modprobes_examples_as_its_man_page_does() -> None:
    """nvidia-modprobe.1: `nvidia-modprobe -c 0 -c 1` creates /dev/nvidia0 and /dev/nvidia1."""
    assert made_by(["-c=0", "-c=1"]) == {"/dev/nvidia0", "/dev/nvidia1"}
    assert made_by(["-u", "-c=0"]) == {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert made_by(["-c=255"]) == {"/dev/nvidiactl"}


def test_the_dgpu_oneshot_makes_every_node_cuda_opens_for_every_gpu_the_driver_has() -> None:
    """The fixture's driver has two GPUs (proc/driver/nvidia/gpus/*/information, Device Minor 0
    and 1) and dev/ has only nvidia0: the unit allows both, and the oneshot makes nvidiactl, both
    GPUs' nodes and nvidia-uvm's two (`-u -c=0` alone made the uvm nodes only)."""
    policy = platform_policy(FIX / "dgpu-x86")
    assert "/dev/nvidia1" in policy.devices and "/dev/nvidia1" not in present_nodes(FIX / "dgpu-x86")
    unit = render_uvm(str(policy.modprobe), nvidia_minors(policy.devices))
    cuda_opens = {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert oneshot_makes(unit) == cuda_opens
    assert oneshot_makes(render_uvm(NVIDIA_MODPROBE)) == cuda_opens - {"/dev/nvidia1"}
    # nvidiactl first: each command loads nvidia.ko, and nvidia-uvm needs it loaded
    assert unit.index("-c=255") < unit.index("-c=0") < unit.index("-u -c=0")
    description = re.search(r"^Description=(.*)$", unit, re.M).group(1)
    assert "nvidiactl" in description and "nvidia-uvm" in description
    assert nvidia_minors(None) == (0,) and nvidia_minors(("/dev/nvidia-uvm", "/dev/nvidiactl")) == (0,)


def image_of(tmp_path: Path, tree: str) -> Path:
    """The fixture as `edge units install --prefix <rootfs>` sees an image: no dev/, no proc/."""
    image = tmp_path / f"{tree}-image"
    shutil.copytree(FIX / tree, image, ignore=shutil.ignore_patterns("dev", "proc"))
    return image


@pytest.mark.parametrize("tree", ["dgpu-x86", "thor-jp7"])
def test_from_an_image_the_oneshot_still_makes_the_nodes_of_the_policy(tmp_path: Path, tree: str) -> None:
    image = image_of(tmp_path, tree)
    (image / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    (image / "usr" / "bin" / "nvidia-modprobe").touch()  # a JetPack 7 image that ships it
    policy = platform_policy(image)
    made = oneshot_makes(render_uvm(str(policy.modprobe), nvidia_minors(policy.devices)))
    assert policy.modprobe and {d for d in policy.devices if re.fullmatch(r"/dev/nvidia(\d+|ctl|-uvm.*)", d)} <= made


def test_jetpack_7_2s_igpu_nodes_under_their_pci_address_are_gpu_nodes(tmp_path: Path) -> None:
    """JetPack 7.2 may name the iGPU's nvgpu nodes by its PCI address (/dev/nvgpu/igpu-0000:01:00.0/*):
    a live tree's are found (doctor scans the same globs) and allowed by path."""
    shutil.copytree(FIX / "thor-jp7", tmp_path / "thor")
    igpu = tmp_path / "thor" / "dev" / "nvgpu" / "igpu-0000:01:00.0"
    igpu.mkdir(parents=True)
    for name in ("ctrl", "as", "channel", "tsg"):
        (igpu / name).touch()
    found = [n for n in present_nodes(tmp_path / "thor") if n.startswith("/dev/nvgpu/")]
    assert len(found) == 4 and set(found) <= set(platform_policy(tmp_path / "thor").devices)
    assert "/dev/nvhost-ctrl-pva0" not in present_nodes(tmp_path / "thor")  # the PVA's, no GPU node


def test_a_live_tree_without_a_gpu_platform_names_no_node_path(tmp_path: Path) -> None:
    """Every missing DeviceAllow= path costs a warning at each start on older systemd: a running
    system with no GPU nodes gets the driver classes only (they resolve to nothing); an image that
    says no platform, and the shipped unit, keep every platform's nodes (the device is unknown)."""
    live = tmp_path / "live"
    (live / "dev").mkdir(parents=True)
    (live / "dev" / "null").touch()
    policy = platform_policy(live)
    assert policy.platform == "any" and not [d for d in policy.devices if d.startswith("/dev/")]
    assert "char-nvidia-uvm" in policy.devices
    image = platform_policy(FIX / "spr-vm")  # no dev/
    assert image.platform == "any" and {"/dev/nvmap", "/dev/nvidia0", "/dev/nvgpu/igpu0/ctrl"} <= set(image.devices)
