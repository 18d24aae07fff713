"""`edge doctor`'s memory check: the models' need against MemAvailable, the cgroup's room and
edge.service's MemoryMax=/MemoryHigh=, naming the setting that does not fit and how to fix it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from edge.device.cgroup import TEST_CGROUP_ROOT_ENV
from edge.device.memory import TEST_MEMINFO_ENV
from edge.host.doctor import run_checks
from edge.host.doctor_memory import show_limits, unit_bytes, unit_limits
from edge.host.units import UnitOptions, install_units
from edge.model.mlock import models_bytes
from edge.config import load_config
from kit import EDGE, write_config
from kit.cgroups import MIB, cgroup_tree

SERVICE = "/system.slice/edge.service"


def test_systemd_sizes_and_settings() -> None:
    assert unit_bytes("infinity") is None and unit_bytes("1G") == 1 << 30 and unit_bytes("512M") == 512 * MIB
    assert unit_bytes("4096") == 4096 and unit_bytes("2T") == 2 << 40 and unit_bytes("64k") == 64 << 10
    assert unit_bytes("25%", total=8 << 30) == 2 << 30 and unit_bytes("25%") is None
    with pytest.raises(ValueError):
        unit_bytes("lots")
    text = "[Service]\nMemoryHigh=1G\nMemoryMax=2G\nMemoryMax=3G\n"
    assert unit_limits(text) == {"MemoryHigh": "1G", "MemoryMax": "3G"}  # the last assignment wins
    # what `systemctl show -p LoadState,MemoryMax,MemoryHigh edge.service` prints
    assert show_limits("LoadState=loaded\nMemoryMax=1073741824\nMemoryHigh=infinity\n") == \
        {"MemoryMax": "1073741824", "MemoryHigh": "infinity"}
    assert show_limits("LoadState=not-found\nMemoryMax=infinity\nMemoryHigh=infinity\n") is None


def _units(tmp_path: Path, cfg: Path) -> Path:
    install_units(UnitOptions(config=str(cfg)), prefix=str(tmp_path / "root"))
    return tmp_path / "root" / "etc" / "systemd" / "system"


def _memory(config: str | None, sysdir: Path):
    return next(c for c in run_checks(config, [sysdir]) if c.name == "memory")


def test_the_units_memory_max_below_the_need_fails_and_names_it(tmp_path: Path, tiny_gguf: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    monkeypatch.setenv(TEST_MEMINFO_ENV, str(tmp_path / "meminfo"))  # 4 GiB available, no cgroup
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    need = models_bytes(load_config(cfg))
    sysdir = _units(tmp_path, cfg)
    ok = _memory(None, sysdir)
    assert ok.level == "ok" and "bounded by MemAvailable" in ok.message, ok
    svc = sysdir / "edge.service"
    svc.write_text(svc.read_text().replace("[Service]\n", f"[Service]\nMemoryMax={need // 2}\n"))
    bad = _memory(None, sysdir)
    assert bad.level == "fail", bad
    assert f"MemoryMax={need // 2} of edge.service (from the installed edge.service)" in bad.message
    assert "systemctl edit edge.service" in bad.fix and "MemoryMax=" in bad.fix
    svc.write_text(svc.read_text().replace(f"MemoryMax={need // 2}\n", "MemoryMax=8G\nMemoryHigh=1K\n"))
    high = _memory(None, sysdir)
    assert high.level == "fail" and "MemoryHigh=1K" in high.message and "MemoryHigh=" in high.fix


def test_a_cgroup_limit_where_the_doctor_runs_is_named(tmp_path: Path, tiny_gguf: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    need = models_bytes(load_config(cfg))
    root = cgroup_tree(tmp_path / "cg", SERVICE, {SERVICE: {"memory.max": need, "memory.current": need // 2}})
    env = {**os.environ, TEST_MEMINFO_ENV: str(tmp_path / "meminfo"), TEST_CGROUP_ROOT_ENV: str(root)}
    r = subprocess.run([*EDGE, "doctor", "--config", str(cfg), "--json"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    memory = next(c for c in json.loads(r.stdout) if c["name"] == "memory")
    assert memory["level"] == "fail" and f"memory.max of cgroup {SERVICE} (v2)" in memory["message"], memory
    assert f"raise the memory limit of cgroup {SERVICE}" in memory["fix"]


def test_the_need_counts_kv_compute_and_the_prompt_caches_bound(tmp_path: Path, tiny_gguf: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What a serving process holds: weights, KV cache, compute buffers and the prompt cache's
    bound, which traffic fills whether or not prefixes are declared (none are here)."""
    from edge.model.gguf import read_gguf_info
    from edge.model.memory import model_need
    from edge.model.mlock import mib

    (tmp_path / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    monkeypatch.setenv(TEST_MEMINFO_ENV, str(tmp_path / "meminfo"))
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="prompt_cache_mb = 72")
    need = model_need(load_config(cfg).models[0], read_gguf_info(tiny_gguf), shared_file=False)
    assert need["prompt_cache"] == 72 * MIB and not load_config(cfg).models[0].prefixes
    check = _memory(str(cfg), _units(tmp_path, cfg))
    total = need["model"] + need["kv_cache"] + need["compute"] + need["prompt_cache"]
    assert f"models need {mib(total)} (weights " in check.message and "prompt cache 72 MiB)" in check.message, check
    assert "plus KV cache" not in check.message
