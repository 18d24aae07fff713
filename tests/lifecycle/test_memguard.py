"""The reload's memory guard on unified memory (a Jetson): offloaded weights, KV cache, compute
buffers and engines are DRAM, whether or not the model file is mapped already."""

from __future__ import annotations

from pathlib import Path

from edge.config import ModelConfig
from edge.model.gguf import GGUFInfo, TensorRecord, offload_split, read_gguf_info
from edge.device.memory import MIB, MemoryReading, unified_memory
from edge.lifecycle.memguard import decide, estimate

FIX = Path(__file__).parents[1] / "fixtures" / "devices"
GIB = 1 << 30


def llama_7b_q4() -> GGUFInfo:
    """The header and tensor table of a Llama-2-7B Q4_K_M (sizes as llama.cpp reports them:
    3.80 GiB of tensors, 32 blocks, 4096-dim, 32 heads, 32000-token vocabulary). Only the header
    is read by the guard, so the table stands for the file."""
    embd, out, block = 70_312_500, 107_520_000, 121_110_528
    tensors = [TensorRecord("token_embd.weight", 0, embd)]
    for i in range(32):
        tensors.append(TensorRecord(f"blk.{i}.attn_q.weight", embd + i * block, block))
    tensors += [TensorRecord("output_norm.weight", embd + 32 * block, 16_384),
                TensorRecord("output.weight", embd + 32 * block + 16_384, out)]
    meta = {"general.architecture": "llama", "llama.block_count": 32, "llama.embedding_length": 4096,
            "llama.attention.head_count": 32, "llama.attention.head_count_kv": 32, "n_vocab": 32000}
    end = tensors[-1].offset + tensors[-1].nbytes
    return GGUFInfo(path="/models/llama-2-7b.Q4_K_M.gguf", size=end + 700_000, version=3,
                    tensor_count=len(tensors), data_offset=700_000, data_bytes=end, metadata=meta,
                    tensors=tuple(tensors))


# test double of the memory reading: an 8 GB Orin with the old set (the same model) loaded
ORIN_8GB = MemoryReading(available=int(2.6 * GIB), total=int(7.4 * GIB), source="test double")


def test_a_fully_offloaded_7b_reload_on_an_8gb_orin_is_sequential_and_says_why() -> None:
    info = llama_7b_q4()
    # the prompt cache off: its bound (sized from this host's RAM when unset) is counted on its own, below
    m = ModelConfig(name="llama", path=info.path, n_ctx=2048, n_batch=512, n_gpu_layers=-1, prompt_cache_mb=0)
    jetson = estimate([(m, info, True)], unified=True)  # same file, mapped by the old set
    row = jetson.models["llama"]
    split = offload_split(info, -1)
    assert row["model"] == split.gpu  # the GPU copies are new DRAM even though the file is mapped
    assert split.gpu == info.data_bytes - 70_312_500  # all but the token embeddings
    assert row["kv_cache"] == 32 * 2048 * 32 * 256 * 2 == GIB
    assert jetson.total > 4.5 * GIB
    d = decide("auto", jetson, ORIN_8GB)
    assert d.mode == "sequential" and "unified memory" in d.reason
    assert d.as_dict()["need"]["unified_memory"] is True
    # what the guard estimated before it counted unified memory: about a GiB, and "overlap"
    dgpu = estimate([(m, info, True)], unified=False)
    assert dgpu.total < 1.5 * GIB and decide("auto", dgpu, ORIN_8GB).mode == "overlap"
    assert dgpu.gpu >= split.gpu + GIB  # a discrete GPU's memory is asked for them instead


def test_engines_count_as_dram_on_unified_memory_and_as_gpu_memory_on_a_dgpu() -> None:
    plan = 300 * MIB
    jetson = estimate([], engines=[("detector", plan)], unified=True)
    assert (jetson.total, jetson.gpu) == (plan, 0)
    dgpu = estimate([], engines=[("detector", plan)], unified=False)
    assert (dgpu.total, dgpu.gpu) == (0, plan)
    tight = MemoryReading(available=plan, total=8 * GIB, source="test double")
    assert decide("auto", jetson, tight).mode == "sequential"


def test_a_cpu_only_model_on_a_jetson_shares_the_mapped_file() -> None:
    info = llama_7b_q4()
    m = ModelConfig(name="llama", path=info.path, n_ctx=2048, n_batch=512, n_gpu_layers=0)
    assert estimate([(m, info, True)], unified=True).models["llama"]["model"] == 0
    assert estimate([(m, info, False)], unified=True).models["llama"]["model"] == info.data_bytes


def test_unified_memory_is_what_the_driver_says_and_the_tegra_release_file_only_without_one(tmp_path: Path) -> None:
    """Inside a Jetson container without /etc/nv_tegra_release the driver still says the GPU is
    integrated (an 8 GB Orin must not reload side by side); the file decides only when no driver
    can be asked: here the real cuda-python, which finds no driver library on this machine."""
    from fakecuda import H100, FakeGpu
    from edge.device.cuda import integrated_gpu

    container = tmp_path  # no etc/nv_tegra_release
    assert unified_memory(container, integrated=lambda: integrated_gpu(FakeGpu().driver)) is True
    assert unified_memory(FIX / "orin-agx", integrated=lambda: integrated_gpu(FakeGpu(H100).driver)) is False
    no_driver = lambda: integrated_gpu(FakeGpu(fail={"cuInit": "CUDA_ERROR_NO_DEVICE"}).driver)  # noqa: E731
    assert unified_memory(FIX / "orin-nano-jp6", integrated=no_driver) and not unified_memory(container, integrated=no_driver)
    if integrated_gpu() is None:  # the real cuda-python without a driver: the file decides
        assert unified_memory(FIX / "orin-agx") and not unified_memory(FIX / "dgpu-x86")


def test_the_prompt_caches_bound_counts_in_a_reloads_need(tiny_gguf: Path) -> None:
    """The prompt cache fills to its bound with traffic, declared prefixes or not (and declared
    and learned ones are restored into it before the switch): its bound counts as DRAM beside the
    old set; only a cache that is off (prompt_cache_mb = 0) counts nothing."""
    import dataclasses

    from edge.config import ModelConfig, PrefixConfig
    from edge.model.memory import model_need, prompt_cache_bytes

    info = read_gguf_info(tiny_gguf)
    off = ModelConfig(name="t", path=str(tiny_gguf), n_ctx=256, prompt_cache_mb=0)
    plain = dataclasses.replace(off, prompt_cache_mb=64)
    declared = dataclasses.replace(plain, prefixes=[PrefixConfig(name="s", text="x")])
    base, more, declared_need = model_need(off, info, False), model_need(plain, info, False), model_need(declared, info, False)
    assert base["prompt_cache"] == 0 and more["prompt_cache"] == declared_need["prompt_cache"] == 64 << 20
    assert more["dram"] - base["dram"] == 64 << 20
    auto = dataclasses.replace(off, prompt_cache_mb=None)  # unset, no prefixes declared: counted too
    assert model_need(auto, info, False)["prompt_cache"] == prompt_cache_bytes(auto, base["kv_cache"]) > 0
    # unset: two contexts' KV, at most 1/16 of RAM
    assert prompt_cache_bytes(auto, base["kv_cache"], total_ram=1 << 40) == 2 * base["kv_cache"]
    assert prompt_cache_bytes(auto, base["kv_cache"], total_ram=16 << 10) == 1 << 10


def test_an_oom_kill_while_serving_makes_reloads_sequential_until_one_succeeds(tmp_path: Path) -> None:
    """The memory guard's fallback after the OOM killer (edge.fleet.crashes cause "oom"): a
    process that served and was OOM-killed (its journal, settled with systemd's word) makes the
    next reload not overlap, even where the reading says both fit; a reload that succeeds later
    ends it. An outside SIGKILL does not."""
    import json
    import time

    from edge.fleet.crashes import settle_all
    from edge.fleet.journal import Journal, Stop
    from edge.lifecycle.memguard import Need, oom_before

    roomy = MemoryReading(available=60 * GIB, total=64 * GIB, source="test double")
    for stop in (Stop("signal", "killed", "KILL"), Stop("oom-kill", "killed", "KILL")):
        j = Journal(tmp_path, clock=lambda: 0.0)  # each "process" started now: the later one is the last
        j.enter("config")
        j.ready()
        j.close()  # its lock released: a process that is gone
        settle_all(tmp_path, stop)
        why = oom_before(tmp_path)
        assert (why is not None) == (stop.result == "oom-kill")
    assert why is not None and "the OOM killer ended pid" in why and "while it served" in why
    decision = decide("auto", Need(), roomy, why)
    assert decision.mode == "sequential" and decision.reason == why
    assert decide("overlap", Need(), roomy, why).mode == "overlap"  # configured: what it says
    (tmp_path / "last-reload.json").write_text(json.dumps({"started_unix": time.time() + 1}))
    assert oom_before(tmp_path) is None


def test_the_start_report_says_what_each_model_holds(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """The start report's `memory_mib` (and `edge status`) count what the guard and `edge doctor`
    count: weights, KV cache, compute buffers and the prompt cache's bound, no prefix declared."""
    import json
    import subprocess

    from edge.model.memory import model_need
    from kit import EDGE, write_config

    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="prompt_cache_mb = 3")
    pid1 = service(cfg)
    assert pid1.stop() == 0
    (row,) = json.loads((tmp_path / "state" / "last-start.json").read_text())["models"]
    need = model_need(ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=256, prompt_cache_mb=3),
                      read_gguf_info(tiny_gguf), shared_file=False)
    assert row["memory_mib"] == {k: round(v / MIB, 2) for k, v in need.items()}
    assert row["memory_mib"]["prompt_cache"] == 3.0 and row["context"]["prompt_cache_limit_bytes"] == 3 * MIB
    shown = subprocess.run([*EDGE, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60).stdout
    assert f"model tiny: memory ~{row['memory_mib']['dram']:.0f} MiB (weights " in shown, shown
    assert "prompt cache up to 3.0 MiB)" in shown, shown
