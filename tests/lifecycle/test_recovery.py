"""Native faults through a real `edge serve` (kit.PidOne) with what systemd adds around it
(kit.unit: ExecStopPost= = `edge record-stop`, Restart=on-failure): every way a start can end is
counted with its phase and signal, two crashes of one phase take its safe fallback, the last one
exits 76, and a client that connected during a crashed start is answered by the next one.

Faults are real signals raised in the service at a named phase (EDGE_TEST_FAULT, docs/faults.md "Native
faults"), or sent from here to a service that EDGE_TEST_FAULT=<phase>:STOP stopped as that phase
began (the signal comes from outside, at a known phase)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from kit import EDGE, PidOne, metric, post, write_config
from kit.unit import Unit, wait_stopped

ASK = {"prompt": "hello", "max_tokens": 2}


def _status(config: Path) -> dict:
    r = subprocess.run([*EDGE, "status", "--json", "--config", str(config)], capture_output=True, text=True,
                       timeout=60)
    return json.loads(r.stdout)


@pytest.fixture(autouse=True)
def _home(edge_home: Path) -> Path:
    return edge_home  # the default state dir (where a broken config's start looks) is the test's own


def _unit(tmp_path: Path, tiny_gguf: Path, fault: str | None, **config) -> Unit:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, **config)
    env = {**os.environ, **({"EDGE_TEST_FAULT": fault} if fault else {})}
    return Unit(PidOne([*EDGE, "serve", "--config", str(cfg)], env=env), cfg)


@pytest.mark.parametrize("phase,sig", [("config", "SEGV"), ("model_load", "BUS"), ("warmup", "ABRT"),
                                       ("mlock_verify", "SEGV")])
def test_a_signal_at_a_phase_is_a_crashed_start_with_its_phase_and_signal(tmp_path: Path, tiny_gguf: Path,
                                                                         phase: str, sig: str) -> None:
    unit = _unit(tmp_path, tiny_gguf, f"{phase}:{sig}")
    with unit.pid1:
        assert unit.start_once() is False
        log = unit.pid1.log_path.read_text()
    [done] = unit.exits
    assert done.returncode == -signal.Signals[f"SIG{sig}"]
    assert f"crashed: killed by SIG{sig} in phase {phase}" in done.recorded
    assert "Fatal Python error" in log and "Current thread" in log  # faulthandler's stacks, in the journal
    crash = _status(unit.config)["crashed_starts"][-1]
    assert (crash["phase"], crash["signal"], crash["result"], crash["settled"]) == (phase, sig, "crashed", True)


def _signal_at(unit: Unit, sig: int, phase: str = "warmup", **stop_post: str) -> None:
    """One start, stopped as `phase` begins; `sig` sent from outside (then SIGCONT); ExecStopPost=."""
    unit.pid1.env["EDGE_TEST_FAULT"] = f"{phase}:STOP"
    unit.signal_stopped(sig, **stop_post)
    del unit.pid1.env["EDGE_TEST_FAULT"]


def test_sigkill_from_outside_during_warmup_is_counted_and_shown(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, None)
    with unit.pid1:
        _signal_at(unit, signal.SIGKILL)
        assert unit.start_until_ready(max_starts=1)
        assert metric(unit.pid1.address, "edge_starts_total", result="crashed") == 1
        assert metric(unit.pid1.address, "edge_crashes_total", phase="warmup", signal="KILL") == 1
        assert metric(unit.pid1.address, "edge_starts_total", result="ok") == 1
        unit.stop()
    [crash] = _status(unit.config)["crashed_starts"]
    assert crash["phase"] == "warmup" and crash["signal"] == "KILL" and crash["model"] == "tiny"


def test_five_starts_each_counted_with_its_own_result(tmp_path: Path, tiny_gguf: Path) -> None:
    """The audit's sequence: good, an unknown config key (78), a config that is not TOML (78),
    SIGKILL during warm-up, good; and SIGTERM during warm-up (stopped), which systemd's
    TimeoutStartSec= makes a timeout."""
    unit = _unit(tmp_path, tiny_gguf, None)
    good = unit.config.read_text()
    with unit.pid1:
        assert unit.start_until_ready(1)
        unit.stop()
        unit.config.write_text(good + "\n[server.nonsense]\nx = 1\n")
        assert unit.start_until_ready(1) is False and unit.exits[-1].returncode == 78
        unit.config.write_text("this is [not toml")
        assert unit.start_until_ready(1) is False and unit.exits[-1].returncode == 78
        unit.config.write_text(good)
        for sig, extra in ((signal.SIGKILL, {}), (signal.SIGTERM, {}), (signal.SIGTERM, {"SERVICE_RESULT": "timeout"})):
            _signal_at(unit, sig, **extra)
        assert unit.start_until_ready(1)
        counts = {r: metric(unit.pid1.address, "edge_starts_total", result=r)
                  for r in ("ok", "failed", "crashed", "stopped", "timeout")}
    assert counts == {"ok": 2, "failed": 2, "crashed": 1, "stopped": 1, "timeout": 1}
    reports = sorted((tmp_path / "state" / "reports").glob("failed-start-*.json"))
    assert len(reports) == 5  # the not-TOML start's too: in the state dir the config named when it was good


def test_two_crashes_of_one_phase_take_its_fallback_and_a_waiting_client_is_answered(
        tmp_path: Path, tiny_gguf: Path) -> None:
    """A fault in llama.cpp's extra buffer types (like ggml's AMX path on a virtualized Sapphire
    Rapids): two crashed starts, then the third serves without them, loudly."""
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV:extra_bufts")
    with unit.pid1:
        answer: dict = {}
        child = unit.pid1.start()
        waiting = threading.Thread(target=lambda: answer.update(r=post(unit.pid1.address, "/v1/completions", ASK,
                                                                       timeout=300)))
        waiting.start()  # connects now, during the start that will crash: held in the socket's backlog
        try:
            unit.pid1.wait_for("READY", "1", pid=child.pid)
        except RuntimeError:
            unit.stop_post(child.wait(30))
        assert unit.start_until_ready(max_starts=3)
        waiting.join(300)
        assert answer["r"][0] == 200 and answer["r"][1]["choices"][0]["text"] is not None
        ready = [n for n in unit.pid1.notifications if "READY" in n.fields][-1]
        assert "SAFE MODE: tiny: llama.cpp without extra buffer types" in ready.fields["STATUS"]
        assert metric(unit.pid1.address, "edge_safe_mode_info", phase="warmup", target="tiny") == 1
        assert metric(unit.pid1.address, "edge_crashes_total", phase="warmup", signal="SEGV") == 2
        unit.stop()
    assert [e.returncode for e in unit.exits] == [-signal.SIGSEGV] * 2 + [0]
    status = _status(unit.config)
    assert [s["fallback"] for s in status["safe_mode"]] == ["llama.cpp without extra buffer types (use_extra_bufts = false)"]
    last = json.loads((tmp_path / "state" / "last-start.json").read_text())
    assert last["safe_mode"][0]["reason"] == "warmup crashed twice in a row (SIGSEGV) under this key"
    assert last["models"][0]["context"]["use_extra_bufts"] is False


def test_when_the_last_fallback_crashes_too_the_start_gives_up_without_a_loop(tmp_path: Path,
                                                                              tiny_gguf: Path) -> None:
    """Two crashes take the step, one more with the step in force exhausts safe mode: the next
    start gives up (edge.lifecycle.unavailable answers 503; tests/lifecycle/test_unavailable.py)."""
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV")  # faults with and without extra buffer types
    with unit.pid1:
        assert unit.start_until_ready(max_starts=6)
        ready = [n for n in unit.pid1.notifications if "READY" in n.fields][-1].fields["STATUS"]
        unit.stop()
    assert [e.returncode for e in unit.exits] == [-signal.SIGSEGV] * 3 + [0]
    assert "GIVEN UP: safe mode exhausted: phase warmup (tiny) crashed again (SIGSEGV) with its last " \
           "fallback in force (llama.cpp without extra buffer types" in ready
    assert "edge safe-mode clear" in ready


def test_a_phase_without_fallback_that_crashes_twice_gives_up(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "imports:SEGV")
    with unit.pid1:
        assert unit.start_until_ready(max_starts=3)
        ready = [n for n in unit.pid1.notifications if "READY" in n.fields][-1].fields["STATUS"]
        unit.stop()
    assert [e.returncode for e in unit.exits] == [-signal.SIGSEGV, -signal.SIGSEGV, 0]
    assert "phase imports crashed twice in a row (SIGSEGV) and it has no safe fallback" in ready


def test_a_crash_while_serving_is_counted_and_two_take_the_fallback(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "serving:SEGV:extra_bufts")
    with unit.pid1:
        for _ in range(2):
            child = unit.pid1.start()
            unit.pid1.wait_for("READY", "1", pid=child.pid)  # it served, then died
            unit.stop_post(child.wait(60))
        child = unit.pid1.start()
        unit.pid1.wait_for("READY", "1", pid=child.pid)
        assert child.poll() is None  # the third serves, in safe mode for every model
        assert post(unit.pid1.address, "/v1/completions", ASK)[0] == 200
        assert metric(unit.pid1.address, "edge_crashes_total", phase="serving", signal="SEGV") == 2
        assert metric(unit.pid1.address, "edge_starts_total", result="ok") == 3
        assert metric(unit.pid1.address, "edge_safe_mode_info", phase="serving", target="*") == 1


def test_safe_mode_clear_ends_it_and_forgets_the_crashes_so_far(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV:extra_bufts")
    with unit.pid1:
        assert unit.start_until_ready(max_starts=3)
        unit.stop()
        r = subprocess.run([*EDGE, "safe-mode", "clear", "--config", str(unit.config)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "tiny: llama.cpp without extra buffer types" in r.stdout
        assert _status(unit.config)["safe_mode"] == []
        # the full path again; the crashes before the clear are counted no more: one new crash is
        # not two in a row, so it takes two more before safe mode is back
        assert unit.start_until_ready(max_starts=3)
        unit.stop()
    assert [e.returncode for e in unit.exits][-4:] == [0, -signal.SIGSEGV, -signal.SIGSEGV, 0]


def test_serving_for_a_while_clears_the_count(tmp_path: Path, tiny_gguf: Path) -> None:
    """A crash, a start that serves [server] healthy_after_s, a crash: not two in a row."""
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV:extra_bufts")
    unit.config.write_text(unit.config.read_text().replace("port = 0", "port = 0\nhealthy_after_s = 1"))
    state = tmp_path / "state" / "safe-mode.json"
    with unit.pid1:
        assert unit.start_once() is False
        unit.pid1.env.pop("EDGE_TEST_FAULT")
        assert unit.start_once()
        _wait_for(lambda: state.exists(), "the start to be marked healthy")
        unit.stop()
        unit.pid1.env["EDGE_TEST_FAULT"] = "warmup:SEGV:extra_bufts"
        assert unit.start_once() is False
        assert unit.start_once() is False
        assert unit.start_once()  # the 2nd and 3rd crash were two in a row: safe mode now
        unit.stop()
    assert [s["target"] for s in _status(unit.config)["safe_mode"]] == ["tiny"]
    assert json.loads(state.read_text())["fallbacks"]["llama:tiny"]["level"] == 1


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.05)


def test_a_journal_without_exit_record_is_settled_by_the_next_start(tmp_path: Path, tiny_gguf: Path) -> None:
    """No ExecStopPost= (a power loss, a plain run): the next start records the crash, signal
    unknown, from what the journal says; `edge status` shows it before that, writing nothing."""
    unit = _unit(tmp_path, tiny_gguf, None)
    journal = tmp_path / "state" / "journal"
    with unit.pid1:
        unit.pid1.env["EDGE_TEST_FAULT"] = "warmup:STOP"
        child = unit.pid1.start()
        wait_stopped(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        del unit.pid1.env["EDGE_TEST_FAULT"]
        crash = _status(unit.config)["crashed_starts"][-1]
        assert (crash["settled"], crash["phase"], crash["signal"]) == (False, "warmup", "unknown")
        assert len(list(journal.glob("*.jsonl"))) == 1
        child = unit.pid1.start()
        unit.pid1.wait_for("READY", "1", pid=child.pid)
        assert metric(unit.pid1.address, "edge_crashes_total", phase="warmup", signal="unknown") == 1
        assert [p.name.split("-")[0] for p in journal.glob("*.jsonl")] == [str(child.pid)]  # only its own


def test_the_state_dir_pointers_forget_configs_that_are_gone(tmp_path: Path, tiny_gguf: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """recovery's pointers (config file -> the state dir it named) hold the configs on the device:
    one removed is dropped at the next write, so the file does not grow with every path ever used."""
    from edge.config import load_config
    from edge.lifecycle.recovery import POINTERS, early_state_dir, remember_state_dir

    monkeypatch.setenv("EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    configs = {}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        configs[name] = write_config(tmp_path / name / "edge.toml", tiny_gguf).resolve()
    for name in ("a", "b"):
        remember_state_dir(load_config(configs[name]))
    pointers = tmp_path / "home" / "state" / POINTERS
    assert json.loads(pointers.read_text()) == {str(configs[n]): str(tmp_path / n / "state") for n in "ab"}
    configs["b"].write_text("not [toml")  # still there: its pointer is what finds its state dir
    assert early_state_dir(str(configs["b"])) == tmp_path / "b" / "state"
    configs["a"].unlink()
    remember_state_dir(load_config(configs["c"]))
    assert set(json.loads(pointers.read_text())) == {str(configs["b"]), str(configs["c"])}
