"""mlock really verified: with RLIMIT_MEMLOCK too low (and CAP_IPC_LOCK dropped, since root
ignores the limit otherwise) the service says so, with the limit and the fix; with GPU offload
the expected bytes are what llama.cpp locks, from the GGUF's tensor table: a mapped file from its
start to the end of the last CPU-resident tensor, else the CPU-resident tensors' buffers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.model.gguf import offload_split, read_gguf_info
from edge.model.mlock import mlock_status
from harness.ggufgen import write_tiny_llama
from kit import EDGE, PidOne, write_config

LIMITED = ["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set=-ipc_lock",
           "--inh-caps=-ipc_lock"]

limited = pytest.mark.skipif(not (shutil.which("prlimit") and shutil.which("setpriv")),
                             reason="needs util-linux prlimit and setpriv")


def _sizes(info) -> dict[str, int]:
    return {t.name: t.nbytes for t in info.tensors}


def test_partial_offload_expects_the_cpu_resident_tensors_of_the_table(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_llama(tmp_path / "m.gguf", n_layer=4))
    size = _sizes(info)
    block = [sum(v for k, v in size.items() if k.startswith(f"blk.{i}.")) for i in range(4)]
    embd, out = size["token_embd.weight"], size["output.weight"] + size["output_norm.weight"]
    assert sum(size.values()) == embd + out + sum(block)
    # llama.cpp since #18148: the output layer first, then the last k - 1 blocks
    s = offload_split(info, 2, output_first=True)
    assert (s.cpu, s.gpu, s.gpu_layers, s.output_on_gpu) == (embd + sum(block[:3]), out + block[3], 1, True)
    # before it: the last k blocks; the output layer only when k > n_layer
    s = offload_split(info, 2, output_first=False)
    assert (s.cpu, s.gpu, s.gpu_layers, s.output_on_gpu) == (embd + sum(block[:2]) + out, sum(block[2:]), 2, False)
    assert offload_split(info, 4, output_first=False).cpu == embd + out
    assert offload_split(info, 5, output_first=False).cpu == embd
    for rule in (True, False):  # -1: everything but the token embeddings, which never leave the CPU
        assert offload_split(info, -1, output_first=rule).cpu == embd
    unknown = offload_split(info, 2, output_first=None)  # the smaller CPU share of the two rules
    assert unknown.cpu == min(embd + sum(block[:3]), embd + sum(block[:2]) + out)
    status = mlock_status(True, unknown.cpu, info, use_mmap=False, n_gpu_layers=2, output_first=None)
    assert status.ok and status.expected_bytes == unknown.cpu and status.as_dict()["gpu_bytes"] == unknown.gpu
    assert not mlock_status(True, unknown.cpu // 2, info, use_mmap=False, n_gpu_layers=2, output_first=None).ok


def _page_up(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-n // page) * page


def test_a_mapped_lock_runs_from_the_files_start_to_the_last_cpu_resident_tensor(tmp_path: Path) -> None:
    """llama.cpp grows one lock over the mapping to the end of each CPU-resident tensor it maps
    (`lmlock->grow_to(offs + size)`): offloaded tensors stored before the last one are locked too.
    This file stores the output layer right after the token embeddings, the blocks after it."""
    info = read_gguf_info(write_tiny_llama(tmp_path / "m.gguf", n_layer=4))
    end = {t.name: info.data_offset + t.offset + t.nbytes for t in info.tensors}
    size = _sizes(info)
    out = size["output.weight"] + size["output_norm.weight"]
    s = offload_split(info, 2, output_first=True)  # output and block 3 offloaded; blocks 0-2 on the CPU
    assert s.locked == end["blk.2.ffn_down.weight"] == info.data_offset + s.cpu + out  # the output too
    status = mlock_status(True, _page_up(s.locked), info, use_mmap=True, n_gpu_layers=2, output_first=True)
    assert status.ok and status.expected_bytes == _page_up(s.locked)
    assert not mlock_status(True, s.cpu, info, use_mmap=True, n_gpu_layers=2, output_first=True).ok
    older = offload_split(info, 2, output_first=False)  # the last two blocks offloaded: stored last
    assert older.locked == end["blk.1.ffn_down.weight"] == info.data_offset + older.cpu
    full = offload_split(info, -1)  # only the token embeddings (stored first) and the header
    assert full.locked == end["token_embd.weight"]
    assert mlock_status(True, full.cpu, info, use_mmap=False, n_gpu_layers=-1).expected_bytes == full.cpu
    from edge.config import ModelConfig
    from edge.model.memory import model_need

    cfg = ModelConfig(name="m", path=info.path, n_gpu_layers=2, use_mlock=True, use_mmap=True)
    assert model_need(cfg, info, shared_file=False)["model"] == offload_split(info, 2, None).locked
    unlocked = ModelConfig(name="m", path=info.path, n_gpu_layers=2, use_mlock=False, use_mmap=True)
    assert model_need(unlocked, info, shared_file=False)["model"] == offload_split(info, 2, None).cpu


def test_tied_embeddings_offloaded_are_reported_as_duplicated(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_llama(tmp_path / "tied.gguf", n_layer=2, tied=True))
    embd = _sizes(info)["token_embd.weight"]
    full = offload_split(info, -1)
    assert full.duplicated == embd and full.cpu == embd and full.output_on_gpu
    assert offload_split(info, 1, output_first=False).duplicated == 0  # output on the CPU: one mapping
    status = mlock_status(True, _page_up(full.locked), info, use_mmap=True, n_gpu_layers=-1, output_first=True)
    assert status.as_dict()["duplicated_bytes"] == embd and status.ok


@limited
def test_required_mlock_that_does_not_take_exits_77(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="require_mlock = true")
    p = subprocess.run([*LIMITED, *EDGE, "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 77, p.stderr
    assert "mlock did not take" in p.stderr
    assert "RLIMIT_MEMLOCK is 0.1 MiB" in p.stderr and "LimitMEMLOCK=infinity" in p.stderr


@limited
def test_optional_mlock_warns_serves_and_reports_it(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    with PidOne([*LIMITED, *EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        # prlimit and setpriv exec in turn, so the service keeps the shell's pid
        pid1.wait_for("READY", "1")
        assert "mlock did not take" in pid1.log_tail(5000)
        report = json.loads((tmp_path / "state" / "last-start.json").read_text())
        mlock = next(p for p in report["phases"] if p["name"] == "mlock_verify")["detail"]
        assert mlock["ok"] is False and mlock["limit_bytes"] == 65536 and mlock["cap_ipc_lock"] is False
        assert mlock["locked_bytes"] < mlock["expected_bytes"]
        assert pid1.stop() == 0


@limited
def test_mlock_takes_when_allowed(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="require_mlock = true")
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        report = json.loads((tmp_path / "state" / "last-start.json").read_text())
        mlock = next(p for p in report["phases"] if p["name"] == "mlock_verify")["detail"]
        assert mlock["ok"] is True and mlock["locked_bytes"] >= mlock["expected_bytes"]
        assert pid1.stop() == 0
