"""Calibrated warm-up on tiny real GGUF models: which candidates are kept, the stored plan and its
key, a corrupt plan file, the budget, and the floor request that always runs.

The one time-based decision is the double's injected delay against the keep threshold: the
double (`FirstUseCostDouble`) sits at the backend boundary, around the llama.cpp model object,
and sleeps only on the first generate() call for one prompt length, the way a lazy GPU kernel
load would. Thresholds in these configs are far above a tiny model's request times.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from edge.config import parse_config
from edge.lifecycle.warmup import calibrate as calibration
from edge.lifecycle.warmup.calibrate import KeepRule, keep_row
from edge.lifecycle.loader import Loader, read_config
from edge.lifecycle.systemd import Notifier
from edge.lifecycle.warmup.after_ready import Watch, start_after_ready
from edge.timing import StartTimer
from edge.errors import ConfigError, WarmupError
from edge.lifecycle.loadset import Loaded
from edge.lifecycle.start import ColdStart
from kit import EDGE, write_config
from kit.prom import until

DELAY_S = 1.5  # the double's first-use cost
# kept only when first - repeat > max(0.5 s, repeat): a tiny model's requests take milliseconds
# one llama.cpp thread: on a shared 2-core machine two threads meet at a barrier per graph node,
# and a descheduled one stalls a tiny model's step by a whole time slice
TINY = "n_batch = 64\nn_threads = 1"
CALIBRATION = "min_gain_s = 0.5\nmin_gain_ratio = 1.0\nbudget_s = 120.0\n"


def _pay() -> None:
    threading.Event().wait(DELAY_S)  # the injected first-use cost (not a wait on anything)


class FirstUseCostDouble:
    """Test double at the llama.cpp boundary (edge.model.native.Native): delegates everything,
    records the whole prompt of every prefill (the tokens reused from the KV cache and those
    decoded now: what the prompt cache's `begin` was given for the sequence), and calls `pay`
    (sleeps DELAY_S) in the first batch decode that holds a chunk of a `slow_len`-token prompt."""

    def __init__(self, native: Any, cache: Any, slow_len: int | None, pay: Callable[[], None] = _pay) -> None:
        object.__setattr__(self, "_native", native)
        object.__setattr__(self, "slow_len", slow_len)
        object.__setattr__(self, "pay", pay)
        object.__setattr__(self, "prompts", [])
        object.__setattr__(self, "_paid", threading.Event())
        object.__setattr__(self, "_starting", {})  # sequence -> the prompt its next chunk starts
        begin = cache.begin

        def recording_begin(seq: int, tokens: list[int], *args: Any, **kw: Any) -> Any:
            self._starting[seq] = list(tokens)
            return begin(seq, tokens, *args, **kw)

        cache.begin = recording_begin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._native, name, value)  # what is set on it is the real context's

    def decode_batch(self, tokens: list[int], pos: list[int], seqs: list[int], out: list[int]) -> None:
        slow = False
        for seq in dict.fromkeys(seqs):
            prompt = self._starting.pop(seq, None)
            if prompt is not None:
                self.prompts.append(prompt)
                slow = slow or len(prompt) == self.slow_len
        if slow and not self._paid.is_set():
            self._paid.set()
            self.pay()
        self._native.decode_batch(tokens, pos, seqs, out)


def install_double(loaded: Loaded, slow_len: int | None, pay: Callable[[], None] = _pay) -> FirstUseCostDouble:
    model = loaded.state.workers["tiny"].model
    double = FirstUseCostDouble(model.native, model.cache, slow_len, pay)
    model.native = model.cache.native = model.slots.native = double
    return double


def rehearse(config: Path, slow_len: int | None = None, recalibrate: bool = False, pay: Callable[[], None] = _pay
             ) -> tuple[dict[str, Any], FirstUseCostDouble]:
    """A start up to READY in this process (ColdStart.rehearse), the double installed through
    ColdStart's before_warm hook."""
    doubles: list[FirstUseCostDouble] = []

    def install(loaded: Loaded) -> None:
        doubles.append(install_double(loaded, slow_len, pay))

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


def test_serve_says_it_calibrates_then_reuses_the_plan(tmp_path: Path, tiny_gguf: Path, service) -> None:
    # before_ready: the start calibrates as an offloaded model's does (CPU models: test_warmlater)
    config = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY,
                          extra=CALIBRATION + 'calibrate = "before_ready"\n')
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


# -- the keep rule and the CPU this process waited for (schedstat) ----------------------------------

class FakeSchedstat:
    """Test double of the schedstat reader (edge.lifecycle.warmup.calibrate.run_delay): the seconds this
    process's threads waited for a CPU, as the test says (None: a kernel without schedstat)."""

    def __init__(self, waited: float | None = 0.0) -> None:
        self.waited = waited

    def read(self) -> float | None:
        return self.waited


def _runs(first: float, repeat: float, waited_first: float | None, waited_repeat: float | None
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"seconds": first, "waited_s": waited_first}, {"seconds": repeat, "waited_s": waited_repeat}


def test_the_keep_rule_takes_off_what_waiting_for_a_cpu_explains() -> None:
    rule = KeepRule(0.02, 0.5)  # threshold max(20 ms, 0.5 x 0.1 s repeat) = 50 ms; the first is 150 ms slower
    assert keep_row({}, *_runs(0.25, 0.1, 0.0, 0.0), rule)["kept"] is True  # nothing waited: a first-use cost
    below = keep_row({}, *_runs(0.25, 0.1, 0.11, 0.01), rule)  # 100 ms of it waiting: 50 ms left, not > 50
    assert below["kept"] is False and below["waited_s"] == pytest.approx(0.1) and "waiting for a CPU" in below["why"]
    above = keep_row({}, *_runs(0.25, 0.1, 0.09, 0.0), rule)  # 90 ms of it waiting: 60 ms left
    assert above["kept"] is True and (above["delay_first_s"], above["delay_repeat_s"]) == (0.09, 0.0)
    more = keep_row({}, *_runs(0.25, 0.1, 0.0, 0.2), rule)  # the repeat waited more: nothing taken off, nothing added
    assert more["kept"] is True and more["waited_s"] == 0.0
    missing = keep_row({}, *_runs(0.25, 0.1, None, None), rule)  # no schedstat: the plain rule, said so
    assert missing["kept"] is True and missing["delay_first_s"] is None and "no schedstat" in missing["why"]


def test_a_first_run_slowed_by_waiting_for_a_cpu_is_not_kept(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSchedstat()
    monkeypatch.setattr(calibration, "run_delay", fake.read)

    def waited() -> None:  # len65's first run is slower by DELAY_S, every bit of it spent waiting for a CPU
        fake.waited = (fake.waited or 0.0) + DELAY_S
        _pay()
    report, _ = rehearse(config, slow_len=65, pay=waited)
    slow = rows(report)["len65"]
    assert slow["gain_s"] > slow["threshold_s"] and slow["kept"] is False, slow
    assert slow["delay_first_s"] - slow["delay_repeat_s"] == pytest.approx(DELAY_S)
    assert "len65" not in [s["name"] for s in json.loads(plan_file(config).read_text())["steps"]]
    report, _ = rehearse(config, slow_len=65, recalibrate=True)  # the same cost, nothing waited: kept
    assert rows(report)["len65"]["kept"] is True and rows(report)["len65"]["delay_first_s"] == 0.0
    fake.waited = None  # a kernel without schedstat: the plain rule
    report, _ = rehearse(config, slow_len=65, recalibrate=True)
    assert rows(report)["len65"]["kept"] is True and "no schedstat" in rows(report)["len65"]["why"]
    assert rows(report)["len65"]["delay_first_s"] is None


# -- calibration after READY (CPU models: calibrate = "auto") ------------------------------------------

def _plan_if_stored(config: Path) -> dict[str, Any] | None:
    return json.loads(plan_file(config).read_text()) if plan_file(config).exists() else None


def test_a_cpu_start_without_a_plan_warms_the_floor_and_calibrates_after_ready(tmp_path: Path, tiny_gguf: Path,
                                                                                service) -> None:
    config = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY,
                          extra=CALIBRATION + "after_ready_idle_s = 0.0\n")
    first = service(config)
    (ready,) = [n.fields["STATUS"] for n in first.notifications if n.fields.get("READY") == "1"]
    assert f"calibrating after ready: tiny (plan to {plan_file(config)})" in ready
    report_file = config.parent / "state" / "last-start.json"
    warm = next(p for p in json.loads(report_file.read_text())["phases"] if p["name"] == "warmup")
    assert warm["detail"]["plan"] == "calibrating after ready"  # the floor only, before READY
    assert [s["name"] for s in warm["detail"]["steps"]] == ["floor"]
    stored = until("the plan stored after READY", lambda: _plan_if_stored(config), timeout=120)
    measured = {c["name"]: c for c in stored["candidates"]}
    assert {"tok1", "chat", "batch2", "batch4", "len65", "len128"} <= set(measured)  # beyond budget_s's reach too
    assert all("first_s" in c and not c.get("pending") for c in measured.values()), measured
    rewritten = until("the start report rewritten", lambda: (lambda r: r if r["calibration"][0]["plan"] ==
                      "calibrated after ready" else None)(json.loads(report_file.read_text())), timeout=60)
    assert rewritten["calibration"][0]["candidates"] == stored["candidates"]
    assert first.stop() == 0
    second = service(config)  # a plan with nothing pending: the start runs it, nothing after READY
    (ready,) = [n.fields["STATUS"] for n in second.notifications if n.fields.get("READY") == "1"]
    assert "calibrating" not in ready
    assert json.loads(report_file.read_text())["calibration"][0]["plan"] == "stored"
    assert second.stop() == 0


def test_a_request_during_calibration_after_ready_is_answered_and_what_it_disturbed_stays_pending(
        tmp_path: Path, tiny_gguf: Path) -> None:
    config = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY,
                          extra=CALIBRATION + "after_ready_idle_s = 0.0\n")
    timer, notifier = StartTimer(), Notifier()
    notifier.enabled = False
    loader = Loader(read_config(str(config), timer), timer, notifier)
    reached, go = threading.Event(), threading.Event()

    def held() -> None:  # len65's first run waits, in llama.cpp's place, until a client request came
        reached.set()
        go.wait(60)

    async def start(loaded: Loaded, ask: bool) -> tuple[int | None, list[str]]:
        await loader.warm(loaded, defer=True)
        names = [n for x in loaded.later for n in (x.names or [])]
        report = tmp_path / "state" / "reports" / "start.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        task = start_after_ready(loaded, loader.config, notifier, {"pid": -1}, report,
                                 Watch(list(loaded.state.workers.values())))
        worker = loaded.state.workers["tiny"]
        watching = worker.on_arrival
        worker.on_arrival = lambda: (watching(), go.set())  # the double lets len65 go once a request came
        status = None
        if ask and await asyncio.to_thread(reached.wait, 60):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=loaded.app), base_url="http://edge") as c:
                status = (await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})).status_code
        await task
        return status, names

    loaded = loader.load()
    install_double(loaded, slow_len=65, pay=held)
    try:
        status, _ = asyncio.run(start(loaded, ask=True))
    finally:
        loaded.close()
    assert status == 200  # answered, not held behind the warm-up
    by_name = {c["name"]: c for c in json.loads(plan_file(config).read_text())["candidates"]}
    for name in ("tok1", "chat", "batch2", "len64"):  # measured before it came
        assert "first_s" in by_name[name] and not by_name[name].get("pending"), by_name[name]
    for name in ("len65", "len128"):  # the one it disturbed, and every one after
        assert by_name[name]["pending"] is True and "first_s" not in by_name[name], by_name[name]
        assert by_name[name]["why"] == "not measured: a request came" and by_name[name]["kept"] is False
    # a later start: floor and kept steps before READY, the pending candidates measured after it
    loaded = loader.load()
    install_double(loaded, slow_len=None)
    try:
        _, names = asyncio.run(start(loaded, ask=False))
    finally:
        loaded.close()
    assert set(names) == {n for n, c in by_name.items() if c.get("pending")}
    stored = json.loads(plan_file(config).read_text())["candidates"]
    assert not [c["name"] for c in stored if c.get("pending")] and len(stored) == len(by_name)
