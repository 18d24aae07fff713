"""Safe mode's decisions on crash records (edge.lifecycle.safemode.SafeMode.decide): what counts, when
a step is taken, and a step that stays no longer than its evidence. Records are what
edge.fleet.crashes writes (the real path from a process's end to a record: tests/fleet/test_crashes.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edge.errors import SafeModeExhausted
from edge.lifecycle.safemode import SafeMode

KEYS = {"llama:tiny": "k1", "llama:*": "k2"}
TOPS = {"llama:tiny": 2, "llama:*": 2}


def _crash(at: float, phase: str = "warmup", signal: str = "SEGV", cause: str | None = None,
           service_result: str = "core-dump") -> dict:
    return {"started_unix": at, "at": f"t{at}", "phase": phase, "model": "tiny", "signal": signal,
            "service_result": service_result, "keys": dict(KEYS), **({"cause": cause} if cause else {})}


def test_two_outside_kills_take_no_step_and_two_native_faults_do(tmp_path: Path) -> None:
    mode = SafeMode.load(tmp_path)
    kills = [_crash(1, "serving", "KILL", service_result="signal"), _crash(2, "serving", "KILL", service_result="signal")]
    assert mode.decide(kills, KEYS, TOPS) == []
    watchdog = [_crash(3, "serving", "ABRT", service_result="watchdog"), _crash(4, "serving", "ABRT", service_result="watchdog")]
    assert mode.decide(kills + watchdog, KEYS, TOPS) == []
    faults = kills + watchdog + [_crash(5, "serving"), _crash(6, "serving")]
    [step] = mode.decide(faults, KEYS, TOPS)
    assert (step.ladder, step.level) == ("llama:*", 1)


def test_one_crash_with_the_step_in_force_climbs_and_the_last_exhausts(tmp_path: Path) -> None:
    mode = SafeMode.load(tmp_path)
    crashes = [_crash(1), _crash(2)]
    assert [s.level for s in mode.decide(crashes, KEYS, TOPS)] == [1]
    crashes.append(_crash(3))  # the step did not remove the fault: the next step at once
    assert [s.level for s in mode.decide(crashes, KEYS, TOPS)] == [2]
    crashes.append(_crash(4, cause="outside-kill"))  # not evidence: nothing changes
    assert mode.decide(crashes, KEYS, TOPS) == []
    crashes.append(_crash(5))
    with pytest.raises(SafeModeExhausted, match="crashed again \\(SIGSEGV\\) with its last fallback in force "
                                                "\\(no GPU offload"):
        mode.decide(crashes, KEYS, TOPS)


def test_a_crash_of_another_phase_with_the_step_in_force_does_not_climb(tmp_path: Path) -> None:
    mode = SafeMode.load(tmp_path)
    crashes = [_crash(1), _crash(2)]
    mode.decide(crashes, KEYS, TOPS)
    assert mode.decide(crashes + [_crash(3, "model_load")], KEYS, TOPS) == []
    assert mode.level("llama:tiny") == 1


def test_a_step_that_served_healthy_is_tried_without_once_and_kept_if_the_full_path_crashes(tmp_path: Path) -> None:
    mode = SafeMode.load(tmp_path)
    crashes = [_crash(1), _crash(2)]
    mode.decide(crashes, KEYS, TOPS)
    mode.healthy()  # served healthy_after_s in the step
    later = SafeMode.load(tmp_path)  # the next (quiet) start
    assert later.decide(crashes, KEYS, TOPS) == [] and later.level("llama:tiny") == 0  # the full path, once
    crashes.append(_crash(time.time()))  # it crashed in the step's phase (after the healthy start)
    again = SafeMode.load(tmp_path)
    [back] = again.decide(crashes, KEYS, TOPS)
    assert (back.level, back.retried) == (1, True)  # the step is back, not the next one
    again.healthy()
    last = SafeMode.load(tmp_path)
    assert last.decide(crashes, KEYS, TOPS) == [] and last.level("llama:tiny") == 1  # for good now


def test_the_full_path_tried_again_that_serves_healthy_ends_the_step(tmp_path: Path) -> None:
    mode = SafeMode.load(tmp_path)
    crashes = [_crash(1), _crash(2)]
    mode.decide(crashes, KEYS, TOPS)
    mode.healthy()
    trying = SafeMode.load(tmp_path)
    trying.decide(crashes, KEYS, TOPS)
    trying.healthy()  # the full path held
    after = SafeMode.load(tmp_path)
    assert after.decide(crashes, KEYS, TOPS) == [] and after.fallbacks == {} and after.trials == {}
