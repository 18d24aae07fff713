"""Calibrated warm-up on tiny real GGUF models: which candidates are kept, the stored plan and its
key, a corrupt plan file, the budget, and the floor request that always runs.

The one time-based decision is the double's injected delay against the keep threshold: the
double (`FirstUseCostDouble`) sits at the backend boundary, around the llama.cpp model object,
and sleeps only on the first generate() call for one prompt length, the way a lazy GPU kernel
load would. Thresholds in these configs are far above a tiny model's request times.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from edge.config import parse_config
from edge.errors import ConfigError, WarmupError
from edge.lifecycle.loadset import Loaded
from edge.lifecycle.start import ColdStart
from kit import EDGE, write_config

DELAY_S = 1.5  # the double's first-use cost
# kept only when first - repeat > max(0.5 s, repeat): a tiny model's requests take milliseconds
# one llama.cpp thread: on a shared 2-core machine two threads meet at a barrier per graph node,
# and a descheduled one stalls a tiny model's step by a whole time slice
TINY = "n_batch = 64\nn_threads = 1"
CALIBRATION = "min_gain_s = 0.5\nmin_gain_ratio = 1.0\nbudget_s = 120.0\n"


class FirstUseCostDouble:
    """Test double at the llama.cpp boundary (edge.model.native.Native): delegates everything,
    records the whole prompt of every prefill (the tokens reused from the KV cache and those
    decoded now: what the prompt cache's `begin` was given for the sequence), and sleeps DELAY_S
    in the first batch decode that holds a chunk of a `slow_len`-token prompt."""

    def __init__(self, native: Any, cache: Any, slow_len: int | None) -> None:
        object.__setattr__(self, "_native", native)
        object.__setattr__(self, "slow_len", slow_len)
        object.__setattr__(self, "prompts", [])
        object.__setattr__(self, "_paid", threading.Event())
        object.__setattr__(self, "_starting", {})  # sequence -> the prompt its next chunk starts
        begin = cache.begin

        def recording_begin(tokens: list[int], *args: Any, **kw: Any) -> Any:
            self._starting[native.seq] = list(tokens)
            return begin(tokens, *args, **kw)

        cache.begin = recording_begin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._native, name, value)  # the current sequence (seq) is the real context's

    def decode_batch(self, tokens: list[int], pos: list[int], seqs: list[int], out: list[int]) -> None:
        slow = False
        for seq in dict.fromkeys(seqs):
            prompt = self._starting.pop(seq, None)
            if prompt is not None:
                self.prompts.append(prompt)
                slow = slow or len(prompt) == self.slow_len
        if slow and not self._paid.is_set():
            self._paid.set()
            threading.Event().wait(DELAY_S)  # the injected first-use cost (not a wait on anything)
        self._native.decode_batch(tokens, pos, seqs, out)


def rehearse(config: Path, slow_len: int | None = None, recalibrate: bool = False
             ) -> tuple[dict[str, Any], FirstUseCostDouble]:
    """A start up to READY in this process (ColdStart.rehearse), the double installed through
    ColdStart's before_warm hook."""
    doubles: list[FirstUseCostDouble] = []

    def install(loaded: Loaded) -> None:
        model = loaded.state.workers["tiny"].model
        doubles.append(FirstUseCostDouble(model.native, model.cache, slow_len))
        model.native = model.cache.native = model.slots.native = doubles[0]

    start = ColdStart(str(config))
    start.before_warm = install
    return start.rehearse(recalibrate=recalibrate), doubles[0]


@pytest.fixture()
def config(tmp_path: Path, tiny_gguf: Path) -> Path:
    return write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY, extra=CALIBRATION)


def plan_of(report: dict[str, Any]) -> dict[str, Any]:
    (plan,) = report["calibration"]
    return plan


def rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in plan_of(report)["candidates"]}


def plan_file(config: Path) -> Path:
    return config.parent / "cache" / "warmup" / "model-tiny.json"


def test_a_first_use_cost_is_kept_and_a_step_without_one_dropped(config: Path) -> None:
    report, double = rehearse(config, slow_len=65)  # len65: one row past n_ubatch, BOS included
    plan, by_name = plan_of(report), rows(report)
    assert plan["plan"] == "calibrated" and plan["why"] == "no stored plan for this model"
    # every path a request can take is a candidate; lengths around n_batch = n_ubatch = 64
    assert {"tok1", "short", "decode_stream", "chat", "chat_stream", "len32", "len33",
            "len63", "len64", "len65", "len128"} <= set(by_name)
    # batched decode: a candidate per batch shape the 4 slots can run (n = 2, 3, 4 choices)
    assert {"batch2", "batch3", "batch4"} <= set(by_name) and "batch5" not in by_name
    assert by_name["len64"]["prompt_tokens"] == 64 and by_name["len65"]["prompt_tokens"] == 65
    slow = by_name["len65"]
    assert slow["kept"] is True and slow["first_s"] >= DELAY_S > slow["threshold_s"]
    assert slow["gain_s"] > slow["threshold_s"]
    assert by_name["len64"]["kept"] is False and by_name["len64"]["gain_s"] <= by_name["len64"]["threshold_s"]
    ran = [w["name"] for w in report["warmup"]]  # every request sent, the repeats too
    assert ran[0] == "floor" and ran.index("len65") + 1 == ran.index("len65.repeat")
    stored = json.loads(plan_file(config).read_text())
    assert "len65" in [s["name"] for s in stored["steps"]] and "len64" not in [s["name"] for s in stored["steps"]]
    # the repeat is the same shape with other tokens: no prefix beyond BOS and a byte-level
    # vocabulary's dummy-prefix bytes, so llama.cpp's prefix cache cannot make it cheap
    firsts = [p for p in double.prompts if len(p) == 65]
    assert len(firsts) == 2 and firsts[0] != firsts[1]
    shared = next(i for i, (a, b) in enumerate(zip(*firsts)) if a != b)
    assert shared <= 4, shared


def test_a_known_key_runs_only_the_stored_plan(config: Path) -> None:
    rehearse(config, slow_len=65)
    report, double = rehearse(config, slow_len=65)
    plan = plan_of(report)
    assert plan["plan"] == "stored" and plan["why"] == "known key"
    kept = json.loads(plan_file(config).read_text())["steps"]
    # the floor, then each kept step once: no repeats, no candidates
    assert [w["name"] for w in report["warmup"]] == ["floor"] + [s["name"] for s in kept]
    assert len(double.prompts) == 1 + len(kept)
    assert rows(report)["len65"]["kept"] is True  # the table of the calibration is shown again


def test_a_changed_key_recalibrates_and_says_why(config: Path, tiny_gguf: Path) -> None:
    rehearse(config)
    write_config(config, tiny_gguf, extra_model=TINY, extra=CALIBRATION, n_ctx=320)
    report, double = rehearse(config)
    plan = plan_of(report)
    assert plan["plan"] == "calibrated" and "n_ctx 256 → 320" in plan["why"]
    assert len(double.prompts) > 2 * len(plan["candidates"]) - 1  # every candidate twice (budget is ample)
    assert json.loads(plan_file(config).read_text())["key"]["n_ctx"] == 320


def test_new_workload_prompts_recalibrate_and_one_that_cannot_fit_fails(config: Path, tiny_gguf: Path) -> None:
    rehearse(config)
    write_config(config, tiny_gguf, extra_model=TINY, extra=CALIBRATION + 'prompts = ["the world"]\n')
    report, _ = rehearse(config)
    assert plan_of(report)["plan"] == "calibrated" and "prompts" in plan_of(report)["why"]
    assert "prompt_0" in rows(report)
    write_config(config, tiny_gguf, extra_model=TINY, extra=CALIBRATION + f'prompts = ["{"word " * 300}"]\n')
    with pytest.raises(ConfigError, match=r"warmup.prompts\[0\]: is \d+ tokens.*context of model 'tiny' \(256 tokens\)"):
        rehearse(config)


def test_edge_warmup_calibrate_measures_anew(config: Path) -> None:
    rehearse(config)
    report, _ = rehearse(config, recalibrate=True)
    assert plan_of(report)["plan"] == "calibrated" and "--calibrate" in plan_of(report)["why"]


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "key": {}, "steps": []}',
                                     '{"format": 1, "key": {}, "steps": [{"name": "x", "path": "nope"}]}',
                                     "[1, 2]"])
def test_a_corrupt_or_foreign_plan_file_is_ignored_with_a_warning(config: Path, content: str,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    plan_file(config).parent.mkdir(parents=True)
    plan_file(config).write_text(content)
    report, _ = rehearse(config)
    plan = plan_of(report)
    assert plan["plan"] == "calibrated" and "ignored" in plan["warning"] and str(plan_file(config)) in plan["warning"]
    assert f"WARNING warm-up plan of tiny: plan file {plan_file(config)}" in capfd.readouterr().err  # the log
    assert json.loads(plan_file(config).read_text())["format"] == 1  # replaced by a good plan


def test_the_floor_runs_when_nothing_else_does(tmp_path: Path, tiny_gguf: Path) -> None:
    # budget 0: no candidate fits; the floor still runs, and what did not fit is reported
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra=CALIBRATION.replace("120.0", "0.0"))
    report, double = rehearse(cfg)
    assert [w["name"] for w in report["warmup"]] == ["floor"]
    assert report["warmup"][0]["events"] >= 1 and len(double.prompts) == 1  # streamed, sampled
    assert all(c["why"].startswith("over budget") and not c["kept"] for c in plan_of(report)["candidates"])
    off = write_config(tmp_path / "off.toml", tiny_gguf, extra="enabled = false\n")
    report, double = rehearse(off)
    assert [w["name"] for w in report["warmup"]] == ["floor"] and len(double.prompts) == 1
    assert plan_of(report)["plan"] == "floor only"


def test_serve_says_it_calibrates_then_reuses_the_plan(config: Path, service) -> None:
    first = service(config)
    assert first.stop() == 0
    statuses = [n.fields.get("STATUS", "") for n in first.notifications]
    assert any(s.startswith("calibrating the warm-up of tiny: no stored plan") for s in statuses)
    second = service(config)
    assert second.stop() == 0
    assert not any("calibrating" in n.fields.get("STATUS", "") for n in second.notifications)
    shown = subprocess.run([*EDGE, "status", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "warm-up plan of tiny: stored plan" in shown.stdout
    assert any(line.startswith("len65") and ("yes" in line or "no" in line) for line in shown.stdout.splitlines())


@pytest.mark.parametrize("field, value", [("budget_s", "-1.0"), ("min_gain_s", '"fast"'),
                                          ("min_gain_ratio", "-0.5")])
def test_warmup_calibration_fields_are_validated(field: str, value: str) -> None:
    text = f'[[models]]\nname = "m"\npath = "m.gguf"\n[warmup]\n{field} = {value}\n'
    with pytest.raises(ConfigError, match=f"warmup.{field}"):
        parse_config(text, source="edge.toml")
