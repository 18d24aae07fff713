"""scripts/gpu-check on a machine without a GPU: a clear skip, and with --require-gpu (what a
device check runs) a fail with the reason, exit 1."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edge.device.identity import probe_gpu

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(probe_gpu().gpu is not None, reason="this machine has a GPU: run scripts/gpu-check itself")


@no_gpu
def test_gpu_check_without_a_gpu_is_a_clear_skip() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["result"] == "skipped" and summary["reason"].startswith("no usable GPU: ")


@no_gpu
def test_gpu_check_that_requires_a_gpu_fails_without_one_saying_why() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--require-gpu"], capture_output=True, text=True,
                       timeout=120)
    summary = json.loads(r.stdout)
    assert r.returncode == 1 and summary["result"] == "fail"
    assert "libcuda.so.1 cannot be loaded" in summary["reason"]  # the real cuda-python, no driver here
