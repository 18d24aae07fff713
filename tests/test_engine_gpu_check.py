"""scripts/gpu-check on a machine without a GPU: one JSON summary that says skipped and why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edge.device import probe_gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(probe_gpu() is not None, reason="this machine has a GPU: run scripts/gpu-check itself")
def test_gpu_check_without_a_gpu_is_a_clear_skip() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["result"] == "skipped"
    assert summary["reason"].startswith(("no GPU query possible", "no NVIDIA driver", "no CUDA device"))
