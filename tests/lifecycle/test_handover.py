"""Process handover against a real `edge serve` (kit.PidOne: socket activation, the notify socket,
MAINPID= followed as systemd follows it): a new process takes over under load and nothing fails;
a new process that crashes or hangs leaves the old one serving; memory too short for both makes
it a restart; a changed installed version makes `edge reload` choose a handover by itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kit import EDGE, ClientLoad, PidOne, metric, post, write_config
from kit.unit import Unit, wait_stopped

import edge

BODY = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()


def correct(status: int, raw: bytes) -> bool:
    return status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1


def edge_reload(cfg: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EDGE, "reload", "--config", str(cfg), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def last_reload(cfg: Path) -> dict:
    return json.loads((cfg.parent / "state" / "last-reload.json").read_text())


def records(cfg: Path) -> list[str]:
    """Crash records and failed starts in the state dir (there must be none after a handover)."""
    folder = cfg.parent / "state" / "reports"
    return sorted(p.name for p in folder.glob("*.json") if p.name.startswith(("crash-", "failed-start-")))


def status_json(cfg: Path) -> dict:
    r = subprocess.run([*EDGE, "status", "--config", str(cfg), "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def thread_nice(pid: int) -> set[int]:
    """The nice values of a process's threads (field 19 of /proc/PID/task/TID/stat)."""
    out = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            out.add(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def test_handover_under_load_fails_nothing_and_mainpid_follows(tmp_path: Path, tiny_gguf: Path,
                                                               service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    pid1 = service(cfg)
    old = pid1.proc
    load = ClientLoad(pid1.address, BODY, clients=8, max_seconds=120, check=correct).start()
    load.wait_ok(20)
    r = edge_reload(cfg, "--process")
    assert r.returncode == 0, r.stderr
    new = last_reload(cfg)["successor"]["pid"]
    pid1.wait_for("MAINPID", str(new), pid=old.pid)  # the datagram the old process sent before its answer
    assert f"handed over to pid {new}" in r.stdout, r.stdout
    assert pid1.proc.pid == new != old.pid  # systemd's main pid (MAINPID=) follows the new process
    assert old.wait(60) == 0  # the old one drained and exited by itself
    before = load.result.ok
    load.wait_ok(before + 20)  # served by the new process alone: its models waited for the old one's drain
    assert "handover: the old process drained in" in pid1.log_tail(200_000)
    result = load.stop()
    assert result.errors == 0 and result.refused == 0, result.error_samples
    assert metric(pid1.address, "edge_requests_total", route="/v1/completions", status="200") >= 20
    report = last_reload(cfg)
    assert report["reload_kind"] == "process" and report["mode"] == "handover" and not report.get("error")
    assert report["successor"]["pid"] == new and report["drain_s"] is not None
    assert [p["name"] for p in report["phases"]] == ["config", "memory_guard", "spawn", "successor_start",
                                                     "switch", "drain"]
    shown = status_json(cfg)  # edge status: the new process's start, the handover that made it
    assert shown["pid"] == new and shown["last_reload"]["successor"]["pid"] == new
    # its start ran 10 nice steps below the service, and every thread serves at the service's again
    assert shown["priority"] == {"nice": 0, "started_at_nice": 10, "restore_failed": []}
    assert thread_nice(new) == {0}
    assert metric(pid1.address, "edge_handovers_total", result="ok") == 1
    svg = tmp_path / "timeline.svg"
    text = subprocess.run([*EDGE, "status", "--config", str(cfg), "--svg", str(svg)], capture_output=True,
                          text=True, timeout=60).stdout
    assert f"handed over to pid {new}" in text and "why: edge reload --process" in text, text
    assert 'data-process="new"' in svg.read_text() and f"new process {new}" in svg.read_text()
    # systemctl stop: ExecStopPost= runs once, for the new main process; nothing is a crash
    stopped = Unit(pid1, cfg).stop()
    assert stopped.returncode == 0, stopped.log
    assert records(cfg) == [] and stopped.recorded == ""


def test_crashed_new_process_leaves_the_old_one_serving(tmp_path: Path, tiny_gguf: Path, service) -> None:
    # the unit's environment as ExecReload= sees it after a daemon-reload: one more variable, which
    # makes `edge reload` choose a handover by itself, and makes the new process fault as it loads
    env = {**os.environ, "INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    pid1 = service(cfg, env=env)
    old = pid1.proc.pid
    load = ClientLoad(pid1.address, BODY, clients=8, max_seconds=120, check=correct).start()
    load.wait_ok(10)
    r = edge_reload(cfg, env={**env, "EDGE_TEST_FAULT": "model_load:SEGV"})
    assert r.returncode != 0
    assert re.search(r"new process \(pid \d+\) was killed by SIGSEGV before it was ready", r.stderr), r.stderr
    load.wait_ok(load.result.ok + 10)
    result = load.stop()
    assert result.errors == 0 and result.refused == 0, result.error_samples
    assert pid1.proc.pid == old and pid1.mainpids == []
    report = last_reload(cfg)
    assert report["why"] == ["the unit's environment changed: EDGE_TEST_FAULT"]
    assert report["successor"]["phase"] == "model_load" and report["successor"]["signal"] == "SEGV"
    assert records(cfg) == []  # the reload failed; no start of the service did
    assert status_json(cfg)["crashed_starts"] == []
    assert metric(pid1.address, "edge_handovers_total", result="failed") == 1


def test_new_process_not_ready_in_time_is_killed(tmp_path: Path, tiny_gguf: Path, service) -> None:
    env = {**os.environ, "INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    pid1 = service(cfg, env=env)
    r = edge_reload(cfg, "--process", "--timeout", "3", env={**env, "EDGE_TEST_FAULT": "warmup:STOP"})
    assert r.returncode != 0 and "did not become ready within 3.0 s: killed" in r.stderr, r.stderr
    new = last_reload(cfg)["successor"]
    assert new["exit"] == -9 and new["phase"] == "warmup"
    assert not Path(f"/proc/{new['pid']}").exists()  # killed and reaped
    assert post(pid1.address, "/v1/completions", json.loads(BODY))[0] == 200
    assert pid1.proc.poll() is None and records(cfg) == []


def test_memory_short_for_both_restarts_instead(tmp_path: Path, tiny_gguf: Path, service) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        1048576 kB\nMemFree:            1024 kB\nMemAvailable:       1024 kB\n")
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    pid1 = service(cfg, env={**os.environ, "EDGE_TEST_MEMINFO": str(meminfo)})
    old = pid1.proc
    load = ClientLoad(pid1.address, BODY, clients=8, max_seconds=120, check=correct).start()
    load.wait_ok(10)
    r = edge_reload(cfg, "--process")
    assert r.returncode == 0, r.stderr
    assert "mode: restart" in r.stdout and "MiB available" in r.stdout, r.stdout
    new = last_reload(cfg)["successor"]["pid"]
    pid1.wait_for("MAINPID", str(new), pid=old.pid)
    assert old.wait(60) == 0 and pid1.proc.pid == new != old.pid
    load.wait_ok(load.result.ok + 10)
    result = load.stop()
    assert result.errors == 0 and result.refused == 0, result.error_samples  # they waited in the backlog
    report = last_reload(cfg)
    assert report["mode"] == "restart" and "drain_old" in [p["name"] for p in report["phases"]]
    assert metric(pid1.address, "edge_handovers_total", result="restart") == 1


@pytest.fixture()
def installed(tmp_path: Path) -> Path:
    """A second installation of edge: this package's code copied, its own `__version__`."""
    site = tmp_path / "site"
    shutil.copytree(Path(__file__).resolve().parents[2] / "edge", site / "edge",  # this checkout's
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def bump_version(site: Path, version: str) -> None:
    init = site / "edge" / "__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{version}"', init.read_text()))


def test_reload_hands_over_once_the_installed_version_changed(tmp_path: Path, tiny_gguf: Path,
                                                              installed: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed), "PYTHONSAFEPATH": "1"}  # the copy, not ./edge
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        old = pid1.proc.pid
        r = edge_reload(cfg, env=env)  # nothing changed on disk: in place
        assert r.returncode == 0 and "kept: tiny" in r.stdout, (r.stdout, r.stderr)
        assert pid1.proc.pid == old and "reload_kind" not in last_reload(cfg)
        bump_version(installed, "0.1.1")
        r = edge_reload(cfg, env=env)
        assert r.returncode == 0, r.stderr
        pid1.wait_for("MAINPID", str(last_reload(cfg)["successor"]["pid"]), pid=old)
        why = last_reload(cfg)["why"]
        assert why == [f"edge 0.1.1 is installed ({installed / 'edge'}), {edge.__version__} runs"]
        assert pid1.proc.pid != old and last_reload(cfg)["successor"]["edge_version"] == "0.1.1"
        assert status_json(cfg)["edge_version"] == "0.1.1"


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_stop_during_a_handover_ends_cleanly(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """`systemctl stop` while the new process warms up: systemd 252 stops a reloading unit with
    SIGTERM (then SIGCONT) to every process of its cgroup, ExecReload='s `edge reload` included,
    and skips ExecStop=. The new process ends, its journal settled into the handover report; the
    old one drains and exits 0; `edge reload` exits 0 (its death by SIGTERM would fail the unit
    with result 'signal'); nothing is recorded as a crash."""
    env = {**os.environ, "INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    pid1 = service(cfg, env=env)
    old = pid1.proc
    reload = subprocess.Popen([*EDGE, "reload", "--config", str(cfg), "--process"], text=True,
                              env={**env, "EDGE_TEST_FAULT": "warmup:STOP"}, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (new := _children(old.pid)):
        assert time.monotonic() < deadline and reload.poll() is None, "no new process"
        threading.Event().wait(0.02)
    wait_stopped(new[0])  # warming up (stopped there by the test's fault switch)
    stopping = time.monotonic()
    for pid in (old.pid, new[0], reload.pid):  # what systemd's stop of a reloading unit sends
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
    _, err = reload.communicate(timeout=60)
    assert reload.returncode == 0 and "superseded by the stop" in err, err
    stopped = Unit(pid1, cfg).stop_post(old.wait(60))
    assert stopped.returncode == 0, stopped.log
    assert records(cfg) == [] and stopped.recorded == "", stopped.recorded
    assert not any("READY" in n.fields for n in pid1.notifications if n.at > stopping and n.pid == old.pid)
    report = last_reload(cfg)
    assert report["error"] and report["successor"]["pid"] == new[0], report
    assert list((tmp_path / "state" / "journal").glob(f"{new[0]}-*.jsonl")) == []
