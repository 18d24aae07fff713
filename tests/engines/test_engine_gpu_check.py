"""scripts/gpu-check: on a machine without a GPU one line (a skip, or with --require-gpu, what a
device check runs, a fail naming why, exit 1); its driver-path rows on the CPU with the doubles
only at the GPU boundary (the CUDA double for the sticky error, mknod'ed nodes for the oneshot)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edge.device.identity import probe_gpu

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(probe_gpu().gpu is not None, reason="this machine has a GPU: run scripts/gpu-check itself")


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@no_gpu
def test_gpu_check_without_a_gpu_is_one_skip_line() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and r.stdout.startswith("gpu-check: skipped: no usable GPU: "), r.stdout


@no_gpu
def test_gpu_check_that_requires_a_gpu_fails_without_one_in_one_line_saying_why() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--require-gpu"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout.count("\n") == 1, r.stdout
    assert r.stdout.startswith("gpu-check: fail: --require-gpu, and no usable GPU: ")
    assert "libcuda.so.1 cannot be loaded" in r.stdout  # the real cuda-python, no driver here


def test_the_sticky_error_row_sees_503_exit_70_and_the_crash_record(tmp_path: Path) -> None:
    """The row's own bookkeeping, with `edge serve` on the CUDA double faulting where the GPU would."""
    from kit.gpudouble import serve_on_fake_gpu
    from kit.ptxtrt import POISON

    check = _gpu_check()
    step, state, detail = check.sticky_row(
        tmp_path, serve=lambda cfg: serve_on_fake_gpu(cfg, fault=("CUDA_ERROR_ILLEGAL_ADDRESS", POISON)))
    assert (step, state) == ("sticky error", "ok"), detail
    assert "HTTP 503" in detail and "exit 70" in detail and "crashed/serving" in detail
    # another sticky error than the kernel's illegal store: the row says what it saw and fails
    step, state, detail = check.sticky_row(
        tmp_path / "other", serve=lambda cfg: serve_on_fake_gpu(cfg, fault=("CUDA_ERROR_LAUNCH_FAILED", POISON)))
    assert state == "fail" and "CUDA_ERROR_LAUNCH_FAILED" in detail, detail


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes (mknod) needs root")
def test_the_oneshot_row_checks_each_promised_node_by_major_and_minor(tmp_path: Path) -> None:
    from edge.host.gpu_nodes import render_uvm

    dev, proc = tmp_path / "dev", tmp_path / "devices"
    dev.mkdir()
    proc.write_text("Character devices:\n195 nvidia\n195 nvidiactl\n509 nvidia-uvm\n\nBlock devices:\n")
    for name, major, minor in (("nvidiactl", 195, 255), ("nvidia0", 195, 0), ("nvidia-uvm", 509, 0),
                               ("nvidia-uvm-tools", 509, 1)):
        os.mknod(dev / name, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    check = _gpu_check()
    uvm = render_uvm("/usr/bin/nvidia-modprobe")
    assert check.oneshot_row(uvm, (0,), None, dev, proc)[1] == "ok"
    step, state, detail = check.oneshot_row(uvm, (0, 1), None, dev, proc)  # a second GPU without its node
    assert state == "fail" and "/dev/nvidia1" in detail
    (dev / "nvidia-uvm-tools").unlink()
    os.mknod(dev / "nvidia-uvm-tools", stat.S_IFCHR | 0o600, os.makedev(509, 2))
    assert "/dev/nvidia-uvm-tools: 509:2, expected 509:1" in check.oneshot_row(uvm, (0,), None, dev, proc)[2]


class SignatureCheckingDriver:
    """The real bindings' module at the driver boundary: each call is bound to the real function's
    signature (a wrong argument count raises TypeError) and recorded, a launch's parameters read
    while they live; nothing runs."""

    def __init__(self) -> None:
        from fakecuda import real

        self.real, self.CUresult, self.calls, self.launched = real, real.CUresult, [], []
        self.made = {"cuCtxGetCurrent": real.CUcontext, "cuModuleLoadData": real.CUmodule,
                     "cuModuleGetFunction": real.CUfunction}

    def __getattr__(self, name: str):
        import ctypes

        fn = getattr(self.real, name)

        def call(*args):
            inspect.signature(fn).bind(*args)
            self.calls.append((name, args))
            if name == "cuLaunchKernel":
                ptrs = (ctypes.c_void_p * 3).from_address(args[9])
                self.launched.append({"x": ctypes.c_uint64.from_address(ptrs[0]).value, "grid": args[1],
                                      "y": ctypes.c_uint64.from_address(ptrs[1]).value, "block": args[4],
                                      "n": ctypes.c_uint32.from_address(ptrs[2]).value, "stream": args[8]})
            return (self.CUresult.CUDA_SUCCESS, *([self.made[name]()] if name in self.made else []))
        return call


def test_the_ptx_engine_calls_the_driver_as_its_bindings_take_them() -> None:
    """kit.ptxtrt runs its kernel through edge's CudaApi: every call is one of the real bindings',
    with their arguments; each launch covers n elements and its parameters point at x, y and n
    (the GPU itself is not here to run the PTX)."""
    from edge.device.cuda import CudaApi
    from kit.ptxtrt import PTX, THREADS, RealGpu

    driver = SignatureCheckingDriver()
    gpu = RealGpu(CudaApi(driver))
    assert gpu.current() is None  # a null CUcontext: none current
    gpu.launch(7, 0x1000, 0x2000, THREADS + 1)
    gpu.launch(7, 0x1000, 0x2000, 4)
    assert [n for n, _ in driver.calls] == ["cuCtxGetCurrent", "cuModuleLoadData", "cuModuleGetFunction",
                                            "cuLaunchKernel", "cuLaunchKernel"]  # compiled once
    assert driver.launched == [{"x": 0x1000, "y": 0x2000, "n": n, "grid": grid, "block": THREADS, "stream": 7}
                               for n, grid in ((THREADS + 1, 2), (4, 1))]
    assert b".entry affine" in PTX and PTX.endswith(b"\x00") and driver.calls[2][1][1] == b"affine"
