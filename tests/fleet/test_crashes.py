"""docs/faults.md "Native faults", the table of every way of ending: a test per row. A real process is
ended that way (a signal from outside, its own exit, systemd's word through `edge record-stop`
with the variables systemd sets), then what it was recorded as (`result`, `cause`) and what two
such ends in a row do to safe mode are read back. The processes here write the start journal and
no model is loaded (edge.fleet.journal: the same file a start writes, the same lock); rows that
need a whole `edge serve` start one (tiny model)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from edge.errors import SafeModeExhausted
from edge.fleet.crashes import NATIVE_CAUSES, recent_crashes
from edge.host.units import UnitOptions, render_service
from edge.lifecycle.safemode import SafeMode
from kit import EDGE, PidOne, write_config
from kit.cgroups import cgroup_tree
from kit.docs import section
from kit.unit import Unit, stop_post_env

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"llama:tiny": "k1", "llama:*": "k2"}
TOPS = {"llama:tiny": 1, "llama:*": 1}
# a process that writes the start journal, enters `phase` and waits: ended from outside
JOURNALED = """
import sys, time
from pathlib import Path
from edge.fleet.journal import Journal
j = Journal(Path(sys.argv[1]))
j.keys({"llama:tiny": "k1", "llama:*": "k2"})
j.enter(sys.argv[2], model="tiny")
print("in", flush=True)
sys.stdin.read()
"""
# a serving process that finds its CUDA context lost: its own crash record, then exit 70
LOST_CONTEXT = """
import sys
from edge.lifecycle.recovery import Recovery
from edge.timing import StartTimer
r = Recovery(sys.argv[1], StartTimer())
r.journal.keys({"llama:tiny": "k1", "llama:*": "k2"})
r.keys = {"llama:tiny": "k1", "llama:*": "k2"}
r.journal.ready()
r.crashed("serving", "CUDA_ERROR_ILLEGAL_ADDRESS: the CUDA context is lost", 70)
sys.exit(70)
"""


# a process that started 20 minutes ago, READY 2 s after exec, serving since (its journal's clock:
# the process's age, as edge.timing's is); ended from outside
SERVED_LONG = """
import sys
from pathlib import Path
from edge.fleet.journal import Journal
ages = iter([1200.0, 1200.0, 2.0])
j = Journal(Path(sys.argv[1]), clock=lambda: next(ages, 1200.0))
j.ready()
print("serving", flush=True)
sys.stdin.read()
"""


def test_a_crash_after_ready_is_dated_when_it_happened_not_at_its_ready(tmp_path: Path) -> None:
    """systemd's word (ExecStopPost= runs as the process is gone) dates the crash: its record, the
    history's count of the last hour, `edge status`'s list; never the READY 20 minutes before."""
    import time

    from edge.fleet.history import Ledger

    cfg = _config(tmp_path)
    state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-c", SERVED_LONG, str(state)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "serving\n"
    before = time.time()
    p.send_signal(signal.SIGSEGV)
    code = p.wait(30)
    _record_stop(cfg, code)
    after = time.time()
    (crash,) = recent_crashes(state)
    assert before <= crash["ended_unix"] <= after and crash["phase"] == "serving", crash
    assert crash["started_unix"] < before - 1190  # it started 20 minutes ago, and was READY then
    assert crash["at"] == time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(crash["ended_unix"]))
    ledger = Ledger(state)
    ledger.update()
    assert ledger.recent(60)["after_ready"] == {"serving/SEGV/native-fault": 1}  # in the last minute
    assert ledger.recent(60, now=before - 600) == {}  # not ten minutes before it happened
    shown = subprocess.run([*EDGE, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert crash["at"] in shown.stdout, shown.stdout


def test_a_crash_with_no_exit_record_is_dated_when_it_is_recorded(tmp_path: Path) -> None:
    """No ExecStopPost= (a power loss): the record's own time, when the next start settles it."""
    import time

    from edge.fleet.crashes import settle_all

    state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-c", SERVED_LONG, str(state)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "serving\n"
    p.kill()
    p.wait(30)
    before = time.time()
    (path,) = settle_all(state)
    report = json.loads(path.read_text())
    assert before <= report["ended_unix"] <= time.time() and report["signal"] == "unknown"


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "edge.toml", tmp_path / "none.gguf")


def _record_stop(cfg: Path, returncode: int, env: dict[str, str] | None = None, **systemd: str) -> None:
    full = {**(env or os.environ), **stop_post_env(returncode), **systemd}
    r = subprocess.run([*EDGE, "record-stop", "--config", str(cfg)], env=full, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def _journaled(cfg: Path, phase: str, sig: int, env: dict[str, str] | None = None,
               between: Callable[[], None] | None = None, record: bool = True, **systemd: str) -> dict:
    """A process in `phase`, ended by `sig` from outside; ExecStopPost= (unless not `record`).
    Its crash record."""
    state = cfg.parent / "state"
    p = subprocess.Popen([sys.executable, "-c", JOURNALED, str(state), phase], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline() == "in\n"
    if between is not None:
        between()
    p.send_signal(sig)
    code = p.wait(30)
    assert code == -sig
    if record:
        _record_stop(cfg, code, env, **systemd)
    return recent_crashes(state)[-1]


def _counts(cfg: Path) -> bool:
    """Whether the crashes so far make safe mode act (a step, or exhausted)."""
    mode = SafeMode.load(cfg.parent / "state")
    try:
        return bool(mode.decide(recent_crashes(cfg.parent / "state"), KEYS, TOPS))
    except SafeModeExhausted:
        return True


def _twice(cfg: Path, phase: str, sig: int, **kw) -> dict:
    _journaled(cfg, phase, sig, **kw)
    return _journaled(cfg, phase, sig, **kw)


def row_native_with_fallback(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE):
        crash = _journaled(cfg, "warmup", sig)
        assert (crash["result"], crash["cause"], crash["signal"]) == ("crashed", "native-fault", sig.name[3:])
        assert crash["service_result"] == "core-dump"
    assert _counts(cfg)  # two in a row of one phase: a step
    assert SafeMode.load(tmp_path / "state").fallbacks["llama:tiny"].level == 1


def row_native_without_fallback(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    crash = _twice(cfg, "imports", signal.SIGSEGV)
    assert (crash["result"], crash["cause"]) == ("crashed", "native-fault")
    with pytest.raises(SafeModeExhausted, match="phase imports .*no safe fallback"):
        SafeMode.load(tmp_path / "state").decide(recent_crashes(tmp_path / "state"), KEYS, TOPS)


def row_sigkill_from_outside(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    crash = _twice(cfg, "serving", signal.SIGKILL)
    assert (crash["result"], crash["cause"], crash["service_result"]) == ("crashed", "outside-kill", "signal")
    assert not _counts(cfg)


def row_oom_killer(tmp_path: Path, tiny_gguf: Path) -> None:
    """The cgroup's oom_kill count (a file tree read in place of /: the test double of the
    cgroup, edge.device.cgroup) grows between the start and ExecStopPost=; and systemd's own word."""
    cfg = _config(tmp_path)
    tree = cgroup_tree(tmp_path / "root", "/system.slice/edge.service",
                       {"/system.slice/edge.service": {"memory.events": "oom 0\noom_kill 0"}})
    env = {**os.environ, "EDGE_TEST_CGROUP_ROOT": str(tree)}
    events = tree / "sys" / "fs" / "cgroup" / "system.slice" / "edge.service" / "memory.events"
    crash = _journaled(cfg, "model_load", signal.SIGKILL, env=env,
                       between=lambda: events.write_text("oom 1\noom_kill 1\n"))
    assert (crash["result"], crash["cause"]) == ("crashed", "oom"), crash
    assert "the cgroup's OOM killer" in crash["error"]
    crash = _journaled(cfg, "model_load", signal.SIGKILL, env=env, SERVICE_RESULT="oom-kill")
    assert crash["cause"] == "oom"
    unrelated = _journaled(cfg, "model_load", signal.SIGKILL, env=env)  # the count did not grow: not this one
    assert unrelated["cause"] == "outside-kill"
    assert not _counts(cfg)


def row_watchdog(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    crash = _twice(cfg, "serving", signal.SIGABRT, SERVICE_RESULT="watchdog")
    assert (crash["result"], crash["cause"], crash["signal"]) == ("crashed", "watchdog", "ABRT")
    assert not _counts(cfg)


def row_start_timeout(tmp_path: Path, tiny_gguf: Path) -> None:
    """systemd's way, both halves: SIGTERM at TimeoutStartSec= (edge's handler ends the start,
    its report says stopped), then ExecStopPost= with SERVICE_RESULT=timeout, which makes it a
    timeout everywhere it is shown: the report, `edge status` (text, JSON, the SVG's marker),
    the counters; and a start that outlived the SIGTERM too (SIGKILL, TimeoutStopSec=)."""
    unit = _unit(tmp_path, tiny_gguf, "warmup:STOP")
    with unit.pid1:
        done = unit.signal_stopped(signal.SIGTERM, SERVICE_RESULT="timeout")
    assert done.returncode == 0 and _reports(tmp_path) == {"failed-start": "timeout"}
    state = tmp_path / "state"
    assert json.loads((state / "last-failed-start.json").read_text())["result"] == "timeout"
    r = subprocess.run([*EDGE, "status", "--config", str(unit.config), "--json"], capture_output=True, text=True,
                       timeout=60)
    assert json.loads(r.stdout)["last_failed_start"]["result"] == "timeout", r.stdout
    svg = tmp_path / "timeout.svg"
    r = subprocess.run([*EDGE, "status", "--config", str(unit.config), "--svg", str(svg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert 'data-marker="timeout"' in svg.read_text() and 'data-marker="stopped"' not in svg.read_text()
    from edge.fleet.history import Ledger

    assert Ledger(state).update()["start"] == {"timeout": 1}  # counted once, as a timeout
    (tmp_path / "killed").mkdir()
    cfg = _config(tmp_path / "killed")
    crash = _twice(cfg, "warmup", signal.SIGKILL, SERVICE_RESULT="timeout")
    assert (crash["result"], crash["cause"]) == ("timeout", "timeout")
    assert not _counts(cfg)


def row_another_signal(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    for sig in (signal.SIGQUIT, signal.SIGUSR1, signal.SIGTERM):
        crash = _journaled(cfg, "warmup", sig)
        assert (crash["result"], crash["cause"]) == ("crashed", "outside-kill"), (sig, crash)
    assert not _counts(cfg)


def row_lost_cuda_context(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", LOST_CONTEXT, str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 70, r.stderr
        _record_stop(cfg, 70)
    crash = recent_crashes(tmp_path / "state")[-1]
    assert (crash["result"], crash["cause"], crash["phase"], crash["signal"]) == \
        ("crashed", "fatal-error", "serving", "none")
    assert _counts(cfg) and "llama:*" in SafeMode.load(tmp_path / "state").fallbacks


def row_no_exit_record(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = _config(tmp_path)
    _journaled(cfg, "warmup", signal.SIGKILL, record=False)
    crash = _journaled(cfg, "warmup", signal.SIGKILL, record=False)
    assert (crash["result"], crash["cause"], crash["signal"], crash["settled"]) == ("crashed", "unknown", "unknown",
                                                                                    False)
    assert _counts(cfg)


def _unit(tmp_path: Path, tiny_gguf: Path, fault: str | None = None) -> Unit:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    env = {**os.environ, **({"EDGE_TEST_FAULT": fault} if fault else {})}
    return Unit(PidOne([*EDGE, "serve", "--config", str(cfg)], env=env), cfg)


def _reports(tmp_path: Path) -> dict[str, str]:
    return {p.name.rsplit("-", 2)[0]: json.loads(p.read_text()).get("result")
            for p in sorted((tmp_path / "state" / "reports").glob("*.json"))}


def row_sigterm_before_ready(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:STOP")
    with unit.pid1:
        done = unit.signal_stopped(signal.SIGTERM)
    assert done.returncode == 0
    assert _reports(tmp_path) == {"failed-start": "stopped"} and recent_crashes(tmp_path / "state") == []


def row_sigterm_while_serving(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf)
    with unit.pid1:
        assert unit.start_once()
        assert unit.stop().returncode == 0
    assert _reports(tmp_path) == {"start": None} and recent_crashes(tmp_path / "state") == []


def _restarted(code: int) -> bool:
    line = next(x for x in render_service(UnitOptions()).splitlines() if x.startswith("RestartPreventExitStatus="))
    return str(code) not in line.split("=", 1)[1].split()


def row_exit_not_restarted(tmp_path: Path, tiny_gguf: Path) -> None:
    assert not any(_restarted(code) for code in (65, 77, 78))
    unit = _unit(tmp_path, tiny_gguf)
    unit.config.write_text(unit.config.read_text() + "\n[server.nonsense]\nx = 1\n")
    with unit.pid1:
        assert unit.start_once() is False and unit.exits[-1].returncode == 78
    assert _reports(tmp_path) == {"failed-start": "failed"} and recent_crashes(tmp_path / "state") == []


def row_exit_restarted(tmp_path: Path, tiny_gguf: Path) -> None:
    assert _restarted(69) and _restarted(70)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, port=taken.getsockname()[1])
    with taken:  # not socket-activated: it binds the port itself, which is in use (70: may pass later)
        r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 70 and "cannot listen on" in r.stderr, r.stderr
    _record_stop(cfg, 70)
    assert _reports(tmp_path) == {"failed-start": "failed"} and recent_crashes(tmp_path / "state") == []


# docs/faults.md row (its first cell) -> its test: here, or where the behaviour lives
ROWS: dict[str, Callable[[Path, Path], None] | str] = {
    "SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGFPE in a phase with fallbacks": row_native_with_fallback,
    "the same in a phase without fallback (`config`, `imports`, `page_in`, ...)": row_native_without_fallback,
    "SIGKILL from outside (a person, a script)": row_sigkill_from_outside,
    "the OOM killer": row_oom_killer,
    "systemd's watchdog (`WatchdogSec=`, SIGABRT)": row_watchdog,
    "systemd's `TimeoutStartSec=`": row_start_timeout,
    "another signal (SIGQUIT, SIGUSR1, SIGTERM before edge's handler)": row_another_signal,
    "a lost CUDA context (by its own word, exit 70)": row_lost_cuda_context,
    "no exit record (power loss, kernel panic)": row_no_exit_record,
    "SIGTERM before READY": row_sigterm_before_ready,
    "SIGTERM while serving (`systemctl stop`/`restart`), drained": row_sigterm_while_serving,
    "`systemctl stop` during a handover": "tests/lifecycle/test_handover.py::test_stop_during_a_handover_ends_cleanly",
    "exit 65, 77, 78 (bad model file, mlock refused, bad config)": row_exit_not_restarted,
    "exit 69, 70": row_exit_restarted,
    "safe mode exhausted":
        "tests/lifecycle/test_unavailable.py::test_an_unconditional_crash_gives_up_once_and_every_request_is_answered_503",
}


def _table_rows() -> dict[str, list[str]]:
    text = section("Native faults: never silent, never a crash loop")  # docs/faults.md
    table = text.split("**Every way of ending**", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {r[0]: r for r in rows}


def test_every_row_of_the_table_has_its_test() -> None:
    assert set(_table_rows()) == set(ROWS)
    for row, test in ROWS.items():
        if isinstance(test, str):
            path, name = test.split("::")
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test


@pytest.mark.parametrize("row", [r for r, t in ROWS.items() if callable(t)])
def test_each_way_of_ending_is_recorded_as_the_docs_say(row: str, tmp_path: Path, tiny_gguf: Path,
                                                           edge_home: Path) -> None:
    cells = _table_rows()[row]
    causes = re.findall(r"`([a-z-]+)`", cells[1])
    counts = cells[2].startswith("counts")
    for cause in causes[1:] if len(causes) > 1 else causes:
        if cause in NATIVE_CAUSES or cause in ("outside-kill", "oom", "watchdog", "timeout"):
            assert (cause in NATIVE_CAUSES) == counts, (row, cause)  # the table's safe-mode column
    ROWS[row](tmp_path, tiny_gguf)  # type: ignore[operator]
