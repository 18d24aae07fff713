"""Identity and history on /metrics of a real `edge serve`: the info families carry this machine's
fields (the same as `edge device`), the start, reload and failed-start counts survive restarts,
engines and OTA state show up, and llama.cpp's GPU offload is read as llama.cpp decides it."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kit import EDGE, write_config
from edge import __version__
from edge.fleet.metrics import FleetCollector, device_labels, ggml_gpu_devices, offloaded_layers, quant_name
from edge.model.gpu import llama_build
from kit import PidOne, get
from kit.ota import A, B, committed, edge_ota, install
from kit.prom import one, samples


def _scrape(address: tuple[str, int]) -> tuple[str, dict]:
    status, text = get(address, "/metrics")
    assert status == 200
    return text, samples(text)


def _edge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, *args], capture_output=True, text=True, timeout=120)


def test_identity_on_metrics_is_this_machine(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    edge = service(cfg)
    _, found = _scrape(edge.address)
    build = one(found, "edge_build_info").labels
    assert build["version"] == __version__ and build["python"] == platform.python_version()
    assert build["llama_cpp_python"] == importlib.metadata.version("llama-cpp-python")
    assert build["backend"] == llama_build() and build["llama_cpp"].count(".") == 2
    device = json.loads(_edge("device", "--json").stdout)  # what `edge device` prints
    assert one(found, "edge_device_info").labels == device_labels(device)
    report = json.loads((tmp_path / "state" / "last-start.json").read_text())
    model = one(found, "edge_model_info", model="tiny").labels
    assert (model["quant"], model["n_ctx"], model["n_gpu_layers"], model["sha256"]) == ("F32", "256", "0", "")
    mlock = report["models"][0]["mlock"]
    assert one(found, "edge_mlock_locked_bytes", model="tiny").value == mlock["locked_bytes"]
    assert one(found, "edge_mlock_expected_bytes", model="tiny").value == mlock["expected_bytes"]
    assert one(found, "edge_mlock_ok", model="tiny").value == float(mlock["ok"])
    assert one(found, "edge_model_gpu_layers_requested", model="tiny").value == 0
    assert one(found, "edge_model_gpu_layers_offloaded", model="tiny").value == 0
    assert one(found, "edge_last_start_seconds", phase="ready").value == report["ready_s"]
    load = sum(p["seconds"] for p in report["phases"] if p["name"] == "model_load")
    assert one(found, "edge_last_start_seconds", phase="model_load").value == pytest.approx(load)
    assert "edge_ota_info" not in found  # no OTA on this device


def test_counts_survive_restarts_and_failed_starts(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    edge = service(cfg)
    _, found = _scrape(edge.address)
    assert one(found, "edge_starts_total", result="ok").value == 1
    assert one(found, "edge_starts_total", result="failed").value == 0
    assert one(found, "edge_reloads_total", result="ok").value == 0
    assert "edge_last_reload_result" not in found
    bigger = write_config(tmp_path / "bigger.toml", tiny_gguf, n_ctx=512)
    r = _edge("reload", "--config", str(bigger))
    assert r.returncode == 0, r.stderr
    _, found = _scrape(edge.address)
    last = json.loads((tmp_path / "state" / "last-reload.json").read_text())
    assert one(found, "edge_reloads_total", result="ok").value == 1
    assert one(found, "edge_last_reload_result", result="ok").value == 1
    assert one(found, "edge_last_reload_duration_seconds").value == last["switch_s"]
    assert one(found, "edge_model_info", model="tiny").labels["n_ctx"] == "512"  # the new set
    assert edge.stop() == 0

    r = _edge("serve", "--config", str(write_config(tmp_path / "bad.toml", tmp_path / "missing.gguf")))
    assert r.returncode == 65, r.stderr

    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as again:  # a restart of the same device
        again.start()
        again.wait_for("READY", "1")
        text, found = _scrape(again.address)
        assert one(found, "edge_starts_total", result="ok").value == 2
        assert one(found, "edge_starts_total", result="failed").value == 1
        assert one(found, "edge_reloads_total", result="ok").value == 1
        assert one(found, "edge_last_reload_result", result="ok").value == 1  # the earlier run's reload
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.skip("promtool not found (Debian package prometheus, scripts/setup): lint skipped")
        p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        assert again.stop() == 0


def test_a_failed_reload_leaves_the_serving_set_on_metrics(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """The new set's app is built (and its state bound) before its warm-up: one whose warm-up fails
    never serves, and /metrics keeps describing the set that does."""
    edge = service(write_config(tmp_path / "edge.toml", tiny_gguf))
    bad = write_config(tmp_path / "bad.toml", tiny_gguf, n_ctx=512,
                       extra_model='chat_template = "{{ undefined_fn() }}"')
    r = _edge("reload", "--config", str(bad))
    assert r.returncode == 70, r.stderr
    _, found = _scrape(edge.address)
    assert one(found, "edge_ready").value == 1
    assert one(found, "edge_model_info", model="tiny").labels["n_ctx"] == "256"
    assert one(found, "edge_reloads_total", result="failed").value == 1
    assert one(found, "edge_last_reload_result", result="failed").value == 1


def test_engine_info_names_the_stored_engine(ort_service) -> None:
    pid1, folder = ort_service
    manifest = json.loads(next((folder / "store").rglob("manifest.json")).read_text())
    _, found = _scrape(pid1.address)
    engine = one(found, "edge_engine_info", engine="mlp").labels
    (name, meta), = manifest["engines"].items()  # the one engine the store holds
    assert engine == {"engine": "mlp", "backend": "onnxruntime", "key": name, "sha256": meta["sha256"],
                      "precision": meta["key"]["precision"]}


def _collect(collector: FleetCollector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return samples(generate_latest(registry).decode())


def test_gpu_layers_as_llama_cpp_decides(tmp_path: Path, tiny_gguf: Path) -> None:
    """A real loaded model; the one thing doubled is the hardware's answer (ggml's GPU devices)."""
    from edge.lifecycle.start import ColdStart

    assert offloaded_layers(-1, 24, 1) == (25, 25)  # all: the output layer is one more
    assert offloaded_layers(99, 24, 1) == (25, 25) and offloaded_layers(10, 24, 1) == (10, 10)
    assert offloaded_layers(10, 24, 0) == (10, 0)  # no GPU device: everything on the CPU
    assert offloaded_layers(10, 24, None) is None and offloaded_layers(0, 24, None) == (0, 0)
    start = ColdStart(str(write_config(tmp_path / "edge.toml", tiny_gguf)))
    start.read_config()
    loaded = start.loader.load()
    try:
        if llama_build() == "cpu":
            assert ggml_gpu_devices() == 0  # the real libggml: a CPU device only
        assert quant_name(15) == "Q4_K_M" and quant_name(None) == ""
        worker = loaded.state.workers["tiny"]
        worker.model.cfg = dataclasses.replace(worker.model.cfg, n_gpu_layers=-1)  # what the config asked
        for gpus, offloaded in ((0, 0.0), (1, 3.0)):  # the tiny model has 2 layers (+ output)
            found = _collect(FleetCollector(tmp_path, lambda: loaded.state, device=dict, gpu_devices=lambda: gpus))
            assert one(found, "edge_model_gpu_layers_requested", model="tiny").value == 3
            assert one(found, "edge_model_gpu_layers_offloaded", model="tiny").value == offloaded
    finally:
        loaded.close()


def test_ota_families_follow_the_ota_state(kit) -> None:
    state = kit["dir"] / "state"
    collector = FleetCollector(state, lambda: None, device=dict)
    assert "edge_ota_info" not in _collect(collector)
    committed(kit, "A")
    found = _collect(collector)
    assert one(found, "edge_ota_info").labels == {"current": A, "previous": "", "pending": "", "highest": A}
    assert one(found, "edge_ota_last_result", version=A, result="committed").value == 1
    assert install(kit, "B", "--no-activate").returncode == 0
    assert one(_collect(collector), "edge_ota_info").labels["pending"] == B
    r = edge_ota(kit, "rollback", "--no-activate")
    assert r.returncode == 0, r.stderr
    found = _collect(collector)
    assert one(found, "edge_ota_last_result", version=B, result="rolled_back").value == 1
    assert one(found, "edge_ota_info").labels["pending"] == ""
    assert one(found, "edge_ota_last_result_timestamp_seconds").value > 0
    (state / "ota" / "state.json").write_text("[1, 2")  # torn or foreign: the spare slot says it
    found = _collect(collector)
    assert one(found, "edge_ota_last_result", version=B, result="rolled_back").value == 1
    (state / "ota" / "state.json.prev").write_text("")  # both slots lost: the markers say it
    found = _collect(collector)
    assert one(found, "edge_ota_last_result", version=B, result="rolled_back").value == 1
    assert one(found, "edge_ota_info").labels["current"] == A
    r = edge_ota(kit, "recover", "--boot")  # the rebuild records what the markers said: no gap
    assert r.returncode == 0, r.stderr
    assert one(_collect(collector), "edge_ota_last_result", version=B, result="rolled_back").value == 1
    for slot in ("state.json", "state.json.prev"):
        (state / "ota" / slot).unlink()
    shutil.rmtree(state / "ota" / "versions")  # no version left: no OTA families, no error
    found = _collect(collector)
    assert "edge_ota_info" not in found and "edge_ota_last_result" not in found


def _event(state: Path, kind: str, ago_s: float, pid: int, **fields) -> None:
    import time

    from edge.timing import write_report

    write_report({"started_unix": time.time() - ago_s, "ready_s": 1.0, "pid": pid, **fields}, state, kind=kind)


def _recent(found: dict) -> tuple[dict, dict]:
    starts = {s.labels["result"]: s.value for s in found["edge_recent_starts"] if s.labels["window"] == "30m"}
    crashes = {s.labels["phase"]: s.value for s in found["edge_recent_crashes"] if s.labels["window"] == "1h"}
    return starts, crashes


def test_recent_starts_and_crashes_are_what_the_device_history_says_of_the_window(tmp_path: Path) -> None:
    """The gauges the alerts use (issue 45): each event counted by when it happened on the
    device, so old failures, operator stops, a recount and a first scrape add nothing new."""
    from edge.fleet.history import CRASH, FAILED_START, LEDGER

    for i, ago in enumerate((7200, 5400, 3000, 3000)):  # long ago: a device back from offline
        _event(tmp_path, FAILED_START, ago, 200 + i, result="failed")
    for i in range(3):
        _event(tmp_path, FAILED_START, 60 * (i + 1), 300 + i, result="stopped")  # an operator's
    _event(tmp_path, FAILED_START, 120, 400, result="crashed", phase="model_load", signal="SEGV")
    for i, ago in enumerate((4000, 1500, 900, 300)):  # crashes while serving, every ~10 minutes
        _event(tmp_path, CRASH, ago, 500 + i, phase="serving", signal="SEGV")
    collector = FleetCollector(tmp_path, lambda: None, device=dict)
    found = _collect(collector)  # the first scrape a fleet Prometheus ever makes of this device
    assert one(found, "edge_starts_total", result="failed").value == 4  # lifetime: what increase() misread
    starts, crashes = _recent(found)
    assert starts == {"ok": 0, "failed": 0, "stopped": 3, "crashed": 1, "timeout": 0, "given_up": 0}
    assert crashes == {"serving": 3}  # the one 4000 s ago is out of the hour
    (tmp_path / LEDGER).write_text('{"format": 1, "counts": [], "seen": 7}')  # damaged: recounted
    again = _collect(FleetCollector(tmp_path, lambda: None, device=dict))
    assert _recent(again) == (starts, crashes)
    _event(tmp_path, FAILED_START, 10, 600, result="timeout")
    _event(tmp_path, FAILED_START, 5, 601, result="failed")
    assert _recent(_collect(collector))[0] == {"ok": 0, "failed": 1, "stopped": 3, "crashed": 1, "timeout": 1, "given_up": 0}
    saved = json.loads((tmp_path / LEDGER).read_text())["events"]
    assert len(saved) == 15  # 13 reports and 2 new; a crashed start is a start and a crash; all within a day
