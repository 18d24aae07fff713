"""Start and reload counts kept across restarts and report pruning (history.json), failed starts
recorded on the failure path, and the OTA state read (never written) as `edge ota` leaves it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit import EDGE, write_config
from edge.fleet.history import FAILED_START, LEDGER, Ledger, read_ota, record_failed_start, reload_result
from edge.timing import ReloadTimer, StartTimer, write_report
from kit.ota import A, B, committed, edge_ota, install


# One start per process: each report gets a pid of its own (a report's file name is
# <kind>-<second>-<pid>, so two written in one second by one pid would share it).
PIDS = itertools.count(100_000)


def _start(state: Path) -> Path:
    return write_report(StartTimer().report(sockets=[], pid=next(PIDS)), state)


def _reload(state: Path, **extra) -> tuple[Path, dict]:
    report = ReloadTimer().report(kind="reload", pid=next(PIDS), **extra)
    return write_report(report, state, kind="reload"), report


def test_counts_grow_by_each_new_report_once(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    assert ledger.update() == {}
    _start(tmp_path)
    _reload(tmp_path, switch_s=0.5, error=None)
    _reload(tmp_path, error="config invalid")
    _reload(tmp_path, error="model missing", rolled_back=True)
    assert ledger.update() == {"start": {"ok": 1}, "reload": {"ok": 1, "failed": 1, "rolled_back": 1}}
    assert ledger.update() == {"start": {"ok": 1}, "reload": {"ok": 1, "failed": 1, "rolled_back": 1}}


def test_a_reload_written_twice_under_two_names_counts_once(tmp_path: Path) -> None:
    """edge.lifecycle.reload writes its report at the switch and again after the drain: in the next
    second, that is a second file name for the same reload."""
    first, report = _reload(tmp_path, switch_s=0.8, error=None, drain_s=None)
    second = first.with_name(first.name.replace(first.name.split("-")[1], "29991231T235959"))
    second.write_text(json.dumps({**report, "drain_s": 0.3, "ready_s": report["ready_s"] + 0.3}))
    assert Ledger(tmp_path).update() == {"reload": {"ok": 1}}


def test_counts_survive_a_restart_and_the_pruning_of_reports(tmp_path: Path) -> None:
    for _ in range(30):
        _start(tmp_path)
    assert Ledger(tmp_path).update() == {"start": {"ok": 30}}
    for _ in range(30):
        _start(tmp_path)
    assert len(list((tmp_path / "reports").glob("start-*.json"))) == 50  # pruned by write_report
    again = Ledger(tmp_path)  # a new process: reads history.json
    assert again.update() == {"start": {"ok": 60}}
    data = json.loads((tmp_path / LEDGER).read_text())
    assert len(data["seen"]) == 50  # only what is on disk is remembered


def test_a_corrupt_ledger_is_recounted_from_the_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _start(tmp_path)
    (tmp_path / LEDGER).write_text("{not json")
    assert Ledger(tmp_path).update() == {"start": {"ok": 1}}
    (tmp_path / LEDGER).write_text(json.dumps({"format": 99, "counts": {"start": {"ok": 7}}, "seen": {}}))
    assert Ledger(tmp_path).update() == {"start": {"ok": 1}}
    assert "not an edge history ledger" in caplog.text


@contextlib.contextmanager
def _unwritable(state_dir: Path) -> Iterator[None]:
    """Writes into `state_dir` fail: a read-only directory, or (root writes anywhere) a file-size
    limit of 0, which fails every write of a byte as a full disk does (EFBIG, SIGXFSZ ignored)."""
    if os.geteuid() != 0:
        dirs = [state_dir, *(p for p in state_dir.rglob("*") if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        try:
            yield
        finally:
            for d in dirs:
                d.chmod(0o755)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_an_unwritable_state_dir_keeps_counts_in_memory(tmp_path: Path) -> None:
    _start(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    ledger = Ledger(tmp_path)
    with _unwritable(tmp_path):
        assert ledger.update() == {"start": {"ok": 1}}
        assert record_failed_start(tmp_path, StartTimer().report()) is None  # no exception
    # nothing half-written: every file is as it was, no temp file left behind
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("text", ["[1, 2]", "not json{"])
def test_a_ledger_that_is_no_json_object_is_recounted_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str) -> None:
    _start(tmp_path)
    (tmp_path / LEDGER).write_text(text)
    assert Ledger(tmp_path).update() == {"start": {"ok": 1}}
    assert "not an edge history ledger" in caplog.text


def test_reloads_in_one_second_are_each_counted(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    for _ in range(4):  # failed reloads of one process, a few ms each
        write_report(ReloadTimer().report(kind="reload", error="bad config", memory=None, mode=None),
                     tmp_path, kind="reload")
    assert ledger.update() == {"reload": {"failed": 4}}
    assert len(list((tmp_path / "reports").glob("reload-*.json"))) == 4
    timer = ReloadTimer()  # one reload written at the switch and again after the drain: once
    for drain in (None, 0.5):
        write_report(timer.report(kind="reload", switch_s=1.0, drain_s=drain), tmp_path, kind="reload")
    assert ledger.update() == {"reload": {"failed": 4, "ok": 1}}


def test_reload_results() -> None:
    assert reload_result({"error": None, "switch_s": 1.0}) == "ok"
    assert reload_result({"error": "bad"}) == "failed"
    assert reload_result({"error": "bad", "rolled_back": True}) == "rolled_back"


def test_a_failed_start_leaves_its_report_and_is_counted(tmp_path: Path, tiny_gguf: Path) -> None:
    """The real `edge serve` with a missing model: exit 65, and the state dir says so."""
    good = write_config(tmp_path / "edge.toml", tiny_gguf)
    bad = write_config(tmp_path / "bad.toml", tmp_path / "missing.gguf")
    r = subprocess.run([*EDGE, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 65, r.stderr
    state = tmp_path / "state"
    failed = json.loads((state / f"last-{FAILED_START}.json").read_text())
    assert failed["result"] == "failed" and failed["exit_code"] == 65 and "missing.gguf" in failed["error"]
    assert [p["name"] for p in failed["phases"]][:3] == ["config", "recovery", "sockets"]  # how far it got
    assert not (state / "last-start.json").exists()  # the last *good* start stays what it was
    assert json.loads((state / LEDGER).read_text())["counts"] == {"start": {"failed": 1}}
    status = subprocess.run([*EDGE, "status", "--config", str(good)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "LAST START FAILED" in status.stdout and "exit 65" in status.stdout


def test_an_invalid_config_failure_is_recorded_where_its_state_dir_says(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "st"}"\n[server]\nport = "eighty"\n'
                   '[[models]]\nname = "m"\npath = "m.gguf"\n')
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, r.stderr
    failed = json.loads((tmp_path / "st" / f"last-{FAILED_START}.json").read_text())
    assert failed["exit_code"] == 78 and "server.port" in failed["error"]


def test_ota_state_as_edge_ota_leaves_it(kit) -> None:
    state = kit["dir"] / "state"
    assert read_ota(state) is None  # no OTA on this device
    committed(kit, "A")
    view = read_ota(state)
    assert (view.current, view.previous, view.pending, view.last_event, view.last_version) == \
        (A, None, None, "committed", A)
    assert view.last_at is not None
    r = install(kit, "B", "--no-activate")
    assert r.returncode == 0, r.stderr
    assert read_ota(state).pending == B
    r = edge_ota(kit, "rollback", "--no-activate")
    assert r.returncode == 0, r.stderr
    view = read_ota(state)
    assert (view.current, view.pending, view.last_event, view.last_version) == (A, None, "rolled back", B)
    before = (state / "ota" / "state.json").read_bytes()
    (state / "ota" / "state.json").write_text("{torn")
    view = read_ota(state)  # torn: state.json.prev and the markers after it, as recover will rebuild it
    assert (view.current, view.pending, view.last_event, view.last_version) == (A, None, "rolled back", B)
    (state / "ota" / "state.json").write_bytes(before)
    shutil.rmtree(state / "ota")
    assert read_ota(state) is None
