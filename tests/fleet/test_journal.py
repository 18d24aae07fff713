"""The start journal read back (edge.fleet.journal) and made a crash record (edge.fleet.crashes),
on journals written by real processes that end the ways a service can end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edge.fleet.crashes import crash_report, recent_crashes, settle_all
from edge.fleet.journal import Stop, journals, read_journal

WRITER = """
import sys, time
from pathlib import Path
from edge.fleet.journal import Journal
j = Journal(Path(sys.argv[1]))
j.enter("imports_http")
j.enter("model_load", model="m")
j.keys({"llama:m": "k1"})
print("written", flush=True)
sys.stdin.readline()  # until the test is done looking at it alive
"""


def _writer(state: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline() == "written\n"
    return p


def test_a_journal_is_alive_while_its_process_runs_and_dead_once_it_is_killed(tmp_path: Path) -> None:
    p = _writer(tmp_path)
    [j] = journals(tmp_path)
    assert j.alive() and j.pid == p.pid and j.end is None
    assert settle_all(tmp_path) == [] and j.path.exists()  # a live process's journal is not touched
    p.kill()
    p.wait()
    assert not j.alive()
    [written] = settle_all(tmp_path, Stop("signal", "killed", "KILL"))
    report = json.loads(written.read_text())
    assert (report["result"], report["phase"], report["model"], report["signal"]) == ("crashed", "model_load", "m", "KILL")
    assert report["keys"] == {"llama:m": "k1"} and not j.path.exists()
    assert [c["phase"] for c in recent_crashes(tmp_path)] == ["model_load"]


def test_a_torn_last_line_is_skipped_and_open_phases_with_a_target_win(tmp_path: Path) -> None:
    p = _writer(tmp_path)
    p.kill()
    p.wait()
    [j] = journals(tmp_path)
    with j.path.open("a") as f:
        f.write('{"enter": "warmup", "t": 1.')  # a crash in the middle of a write
    j = read_journal(j.path)
    assert j is not None and [e["enter"] for e in j.entered] == ["imports_http", "model_load"]
    report = crash_report(j)
    assert report["phase"] == "model_load" and report["signal"] == "unknown"
    assert [p["detail"].get("unfinished") for p in report["phases"]] == [True, True]


def test_a_stop_by_sigterm_that_systemd_timed_out_is_a_timeout(tmp_path: Path) -> None:
    """A start stopped by the SIGTERM of TimeoutStartSec=: its own report says stopped, systemd's
    ExecStopPost word makes it a timeout."""
    from edge.fleet.history import Ledger, record_failed_start
    from edge.fleet.journal import Journal

    j = Journal(tmp_path)
    report = {"edge_version": "x", "pid": j.pid, "host": "h", "started_at": "2026-12-03T00:00:00+0000",
              "ready_s": 1.0, "phases": [], "exit_code": 0}
    path = record_failed_start(tmp_path, {**report, "result": "stopped"}, count=False)
    j.end("stopped", 0, report=path.name)
    settle_all(tmp_path, Stop("timeout", "exited", "0"))
    assert json.loads(path.read_text())["result"] == "timeout"
    assert Ledger(tmp_path).update()["start"] == {"timeout": 1}


def test_stop_says_the_signal_only_when_systemd_says_it_was_killed() -> None:
    env = {"SERVICE_RESULT": "core-dump", "EXIT_CODE": "dumped", "EXIT_STATUS": "SEGV"}
    assert Stop.from_env(env).signal == "SEGV"
    assert Stop.from_env({**env, "SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}).signal == "KILL"
    assert Stop.from_env({"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "78"}).signal is None


def test_lines_are_synced_by_the_thread_and_no_child_inherits_the_journal(tmp_path: Path) -> None:
    from edge.fleet.journal import Journal

    j = Journal(tmp_path)
    j.enter("model_load", model="m")
    held = [int(fd.name) for fd in Path("/proc/self/fd").iterdir() if _points_to(fd, j.path)]
    # the writer's descriptor and the syncer's: a child spawned with them (a handover's new process)
    # would hold the journal's lock, and this process would look alive after its death
    assert len(held) == 2 and not any(os.get_inheritable(fd) for fd in held)
    j.close()  # what was asked is synced before the syncer's descriptor closes
    cost = j.cost()
    assert cost["lines"] == 2 and cost["syncs"] >= 1 and cost["sync_seconds"] > 0
    assert not [fd for fd in Path("/proc/self/fd").iterdir() if _points_to(fd, j.path)]
    [read] = journals(tmp_path)
    assert read.entered[-1]["enter"] == "model_load" and read.end is None and not read.alive()


def _points_to(fd: Path, path: Path) -> bool:
    try:
        return os.readlink(fd) == str(path)
    except OSError:
        return False
