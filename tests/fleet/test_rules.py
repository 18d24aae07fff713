"""The Prometheus rules shipped with edge (edge/fleet/rules/edge-rules.yml, `edge fleet rules`): in the
wheel, valid for `promtool check rules`, and unit-tested with `promtool test rules`: input series
for every alert, which must fire where it should and stay silent where it should not, and the
fleet's p50/p95 ready time by module and model computed from known values."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kit import EDGE
from kit.prom import need

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "edge" / "fleet" / "rules" / "edge-rules.yml"


def _printed_rules(tmp_path: Path) -> Path:
    r = subprocess.run([*EDGE, "fleet", "rules"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == RULES.read_text()
    path = tmp_path / "edge-rules.yml"
    path.write_text(r.stdout)
    return path


def test_printed_rules_pass_promtool_check(tmp_path: Path) -> None:
    promtool = need("promtool")
    rules = _printed_rules(tmp_path)
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(re.findall(r"^ +- (?:record|alert): ", rules.read_text(), re.M))
    assert n >= 14 and f"SUCCESS: {n} rules found" in r.stdout  # promtool read every rule of the file


def test_rules_file_is_in_the_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build leaves build/ and *.egg-info where it runs
    shutil.copytree(ROOT / "edge", src / "edge", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No matching distribution" in r.stderr:
        pytest.skip(f"cannot build a wheel here (no index for the build backend): {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr
    wheel = next((tmp_path / "dist").glob("edge-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert z.read("edge/fleet/rules/edge-rules.yml").decode() == RULES.read_text()


# -- promtool test rules ------------------------------------------------------------------------------
def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _device(instance: str, module: str, model: str, ready: float) -> list[dict[str, str]]:
    dev = {"job": "edge", "instance": instance}
    info = {**dev, "module": module, "platform": module.lower().replace(" ", "-"), "jetpack": "",
            "l4t": "36.4.0", "sm": "sm_87", "cpu_arch": "aarch64"}
    return [_series("edge_last_start_seconds", {**dev, "phase": "ready"}, f"{ready}x30"),
            _series("edge_device_info", info, "1x30"),
            _series("edge_model_info", {**dev, "model": model, "quant": "Q4_K_M", "sha256": "ab",
                                        "n_ctx": "2048", "n_gpu_layers": "-1"}, "1x30")]


def _start_test() -> dict:
    """21 Orin NX devices serving gemma: 20 ready in 4..5.9 s, one in 20 s (the only outlier:
    p95 x 1.5 is 8.4 s); 3 AGX devices all alike (silent); a fleet of one (silent)."""
    series = [s for i in range(20) for s in _device(f"nx{i}", "Orin NX", "gemma", 4 + i * 0.1)]
    series += _device("nx-slow", "Orin NX", "gemma", 20)
    series += [s for i in range(3) for s in _device(f"agx{i}", "AGX Orin", "gemma", 3)]
    series += _device("nano0", "Orin Nano", "qwen", 9)
    slow = {"job": "edge", "instance": "nx-slow", "module": "Orin NX", "platform": "orin-nx",  # jetpack "": no label
            "l4t": "36.4.0", "model": "gemma", "quant": "Q4_K_M", "sha256": "ab", "n_ctx": "2048",
            "n_gpu_layers": "-1"}
    p = "module_model:edge_last_start_ready_seconds"
    return {"interval": "1m", "input_series": series,
            "promql_expr_test": [
                {"expr": f'{p}:p50{{module="Orin NX"}}', "eval_time": "10m",
                 "exp_samples": [{"labels": f'{p}:p50{{module="Orin NX",model="gemma"}}', "value": 5.0}]},
                {"expr": f"{p}:p95", "eval_time": "10m", "exp_samples": [
                    {"labels": f'{p}:p95{{module="Orin NX",model="gemma"}}', "value": 5.9},
                    {"labels": f'{p}:p95{{module="AGX Orin",model="gemma"}}', "value": 3},
                    {"labels": f'{p}:p95{{module="Orin Nano",model="qwen"}}', "value": 9}]}],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "EdgeStartSlowerThanFleet", "exp_alerts": []},  # for: 5m
                {"eval_time": "10m", "alertname": "EdgeStartSlowerThanFleet", "exp_alerts": [
                    {"exp_labels": {**slow, "severity": "warning"},
                     "exp_annotations": {
                         "summary": "edge on nx-slow took 20s to READY: more than 1.5 x the fleet's p95 "
                                    "for Orin NX / gemma",
                         "description": "`edge status --svg start.svg` on the device draws where the time went."}}]}]}


def _alerts_test() -> dict:
    dev = {"job": "edge"}
    series = [
        # not ready: a stuck 15 minutes (fires after 10), b for 5 then ready (silent), c not answering
        _series("edge_ready", {**dev, "instance": "a"}, "0x20"),
        _series("edge_ready", {**dev, "instance": "b"}, "0x5 1x15"),
        _series("up", {**dev, "instance": "b"}, "1x20"),
        _series("up", {**dev, "instance": "c"}, "0x20"),
        # OTA: a rolled back, b committed
        _series("edge_ota_last_result", {**dev, "instance": "a", "version": "2.0.0", "result": "rolled_back"}, "1x20"),
        _series("edge_ota_last_result", {**dev, "instance": "b", "version": "2.0.0", "result": "committed"}, "1x20"),
        # mlock: a not taken, b taken
        _series("edge_mlock_ok", {**dev, "instance": "a", "model": "m"}, "0x20"),
        _series("edge_mlock_ok", {**dev, "instance": "b", "model": "m"}, "1x20"),
        # GPU: a asked 25 layers and got none, b got all 25, c runs on the CPU by config
        _series("edge_model_gpu_layers_requested", {**dev, "instance": "a", "model": "m"}, "25x20"),
        _series("edge_model_gpu_layers_offloaded", {**dev, "instance": "a", "model": "m"}, "0x20"),
        _series("edge_model_gpu_layers_requested", {**dev, "instance": "b", "model": "m"}, "25x20"),
        _series("edge_model_gpu_layers_offloaded", {**dev, "instance": "b", "model": "m"}, "25x20"),
        _series("edge_model_gpu_layers_requested", {**dev, "instance": "c", "model": "m"}, "0x20"),
        _series("edge_model_gpu_layers_offloaded", {**dev, "instance": "c", "model": "m"}, "0x20"),
        # safe mode: a's model without extra buffer types since minute 3; b never
        _series("edge_safe_mode_info", {**dev, "instance": "a", "phase": "warmup", "target": "m",
                                        "reason": "llama.cpp without extra buffer types"}, "_x3 1x17"),
    ]

    def fired(name: str, labels: dict[str, str], severity: str, summary: str, description: str) -> dict:
        return {"exp_labels": {**dev, **labels, "severity": severity},
                "exp_annotations": {"summary": summary, "description": description}}

    not_ready = ("Check `edge status` and `journalctl -u edge` on the device (a failed start leaves its "
                 'report: edge_starts_total{result="failed"}).')
    return {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "9m", "alertname": "EdgeNotReady", "exp_alerts": []},
        {"eval_time": "15m", "alertname": "EdgeNotReady", "exp_alerts": [
            fired("EdgeNotReady", {"instance": "a"}, "critical",
                  "edge on a has not been ready for 10 minutes", not_ready),
            fired("EdgeNotReady", {"instance": "c"}, "critical",
                  "edge on c has not been ready for 10 minutes", not_ready)]},
        {"eval_time": "1m", "alertname": "EdgeOtaRolledBack", "exp_alerts": [
            fired("EdgeOtaRolledBack", {"instance": "a", "version": "2.0.0", "result": "rolled_back"}, "warning",
                  "OTA 2.0.0 was rolled back on a (rolled_back)",
                  "`edge ota status` on the device has the reason in its history.")]},
        {"eval_time": "5m", "alertname": "EdgeMlockNotTaken", "exp_alerts": [
            fired("EdgeMlockNotTaken", {"instance": "a", "model": "m"}, "warning",
                  "model m on a is not locked in memory",
                  "mlock did not take (RLIMIT_MEMLOCK / LimitMEMLOCK): the model stays pageable and may be "
                  "evicted. `edge doctor` says how to fix it.")]},
        {"eval_time": "5m", "alertname": "EdgeModelOnCpu", "exp_alerts": [
            fired("EdgeModelOnCpu", {"instance": "a", "model": "m"}, "critical",
                  "model m on a runs 0 layers on the GPU, fewer than configured",
                  "llama.cpp found no GPU device (device nodes, DeviceAllow=, driver): the model runs on the CPU.")]},
        {"eval_time": "3m", "alertname": "EdgeSafeMode", "exp_alerts": []},  # not yet, then for: 1m
        {"eval_time": "5m", "alertname": "EdgeSafeMode", "exp_alerts": [
            fired("EdgeSafeMode", {"instance": "a", "phase": "warmup", "target": "m",
                                   "reason": "llama.cpp without extra buffer types"}, "critical",
                  "edge on a runs in safe mode: m: llama.cpp without extra buffer types",
                  "warmup crashed twice in a row. `edge status` on the device lists the crashes (phase, "
                  "signal) and `journalctl -u edge` has their stacks; once fixed, `edge safe-mode clear`.")]},
    ]}


def _prompt_cache_test() -> dict:
    """a: 90 % hits for a day, then 10 % for 60 min (fires); b: 90 % throughout; c: 10 % all day
    (low, but no collapse: silent)."""
    day = 1440
    dev = {"job": "edge", "model": "m"}

    def counter(per_min: int, then_per_min: int) -> str:
        return f"0+{per_min}x{day} {per_min * day + then_per_min}+{then_per_min}x59"

    series = [_series("edge_prompt_cache_hits_total", {**dev, "instance": "a"}, counter(90, 10)),
              _series("edge_prompt_cache_misses_total", {**dev, "instance": "a"}, counter(10, 90)),
              _series("edge_prompt_cache_hits_total", {**dev, "instance": "b"}, counter(90, 90)),
              _series("edge_prompt_cache_misses_total", {**dev, "instance": "b"}, counter(10, 10)),
              _series("edge_prompt_cache_hits_total", {**dev, "instance": "c"}, counter(10, 10)),
              _series("edge_prompt_cache_misses_total", {**dev, "instance": "c"}, counter(90, 90))]
    description = ("The prefixes the traffic sends no longer match the cached ones (a changed system "
                   "prompt or template, or a cache limit too small).")
    return {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": f"{day}m", "alertname": "EdgePromptCacheHitRateCollapse", "exp_alerts": []},
        {"eval_time": f"{day + 59}m", "alertname": "EdgePromptCacheHitRateCollapse", "exp_alerts": [
            {"exp_labels": {**dev, "instance": "a", "severity": "warning"},
             "exp_annotations": {"summary": "prompt-cache hit ratio of m on a fell to 10%, under half its daily ratio",
                                 "description": description}}]}]}


def _silence_test() -> dict:
    """a pushes for 10 minutes, then nothing (power or uplink gone); b pushes throughout, not ready
    for a while (EdgeNotReady's case, not this one)."""
    dev = {"job": "edge"}
    series = [_series("edge_ready", {**dev, "instance": "a"}, "1x10"),
              _series("edge_ready", {**dev, "instance": "b"}, "1x10 0x10 1x40")]
    silent = ("The device or its agent is down, or its uplink is: nothing reaches the fleet (a pushing "
              "device cannot report up == 0).")
    return {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "14m", "alertname": "EdgeDeviceSilent", "exp_alerts": []},  # lookback, then for: 10m
        {"eval_time": "30m", "alertname": "EdgeDeviceSilent", "exp_alerts": [
            {"exp_labels": {**dev, "instance": "a", "severity": "critical"},
             "exp_annotations": {"summary": "edge on a has sent no metrics for 15 minutes",
                                 "description": silent}}]},
    ]}


def _fired(alert: str, instance: str, n: int) -> dict:
    what = {"EdgeStartsFailing": (f"failed to start {n} times in 30 minutes", "A restart loop: `edge status` on "
                                  "the device shows the last failed start's report and exit code."),
            "EdgeCrashLoop": (f"crashed {n} times after READY in the last hour", "A crash loop while serving: "
                              "`edge status` on the device lists the crashes (phase, signal) and `journalctl "
                              "-u edge` has their stacks.")}[alert]
    return {"exp_labels": {"job": "edge", "instance": instance, "severity": "critical"},
            "exp_annotations": {"summary": f"edge on {instance} {what[0]}", "description": what[1]}}


def _recent(instance: str, result: str, values: str) -> dict[str, str]:
    return _series("edge_recent_starts", {"job": "edge", "instance": instance, "result": result, "window": "30m"},
                   values)


def _total(instance: str, result: str, values: str) -> dict[str, str]:
    return _series("edge_starts_total", {"job": "edge", "instance": instance, "result": result}, values)


# case -> (its series: what the device reports, lifetime counters beside its own window; when the
# alert must fire: [(from, to)] minutes). A device's gauge is what its history says of the last 30
# minutes, so each case is what the device would report in that story.
STARTS_CASES: dict[str, tuple[list[dict[str, str]], list[tuple[int, int]]]] = {
    # a restart loop: 1, 2, 3 failures in 30 minutes, then 30 minutes after the last one, none
    "loop": ([_recent("loop", "failed", "0x4 1x5 2x5 3x20 0x63"), _total("loop", "failed", "0x4 1x5 2x5 3x83")],
             [(17, 37)]),
    # lifetime failed=5 long ago; offline for an hour (no samples), back with nothing new
    "back": ([_recent("back", "failed", "0x10 _x60 0x29"), _total("back", "failed", "5x10 _x60 5x29")], []),
    # a fleet Prometheus that has just started, over a device with failed=4, stopped=6 from before
    "fresh": ([_recent("fresh", "failed", "0x99"), _recent("fresh", "stopped", "0x99"),
               _total("fresh", "failed", "4x99"), _total("fresh", "stopped", "6x99")], []),
    # history.json damaged and recounted from the reports on disk: 10 -> 4; a state dir wiped: 7 -> 0
    "recount": ([_recent("recount", "failed", "0x99"), _total("recount", "failed", "10x10 4x88")], []),
    "reset": ([_recent("reset", "failed", "0x99"), _total("reset", "failed", "7x10 0x88")], []),
    # an operator stops the service 4 times in 20 minutes: no start failed
    "stops": ([_recent("stops", "stopped", "1 2 3 4x96"), _recent("stops", "failed", "0x99"),
               _total("stops", "stopped", "1 2 3 4x96")], []),
    # a boot loop from the first scrape (first seen at 3), and one of crashed and timed-out starts
    "boot": ([_recent("boot", "failed", "_x5 3x94"), _total("boot", "failed", "_x5 3x94")], [(5, 99)]),
    "mixed": ([_recent("mixed", "crashed", "_x5 2x94"), _recent("mixed", "timeout", "_x5 1x94"),
               _recent("mixed", "ok", "_x5 9x94")], [(5, 99)]),
    # a device removed from the fleet while it failed: its series end, the alert resolves
    "gone": ([_recent("gone", "failed", "3x10")], [(0, 10)]),
}
CRASHES_CASES: dict[str, tuple[list[dict[str, str]], list[tuple[int, int]]]] = {
    # crashes while serving every 6 minutes (past healthy_after_s: safe mode never engages)
    "serving": ([_series("edge_recent_crashes", {"job": "edge", "instance": "serving", "phase": "serving",
                                                 "window": "1h"}, " ".join(f"{k}x5" for k in range(10)) + " 10x39")],
                [(18, 99)]),
    # first seen with 15 crashes in its lifetime, none in the last hour
    "old": ([_series("edge_crashes_total", {"job": "edge", "instance": "old", "phase": "serving", "signal": "SEGV"},
                     "15x99"),
             _series("edge_recent_crashes", {"job": "edge", "instance": "old", "phase": "serving", "window": "1h"},
                     "0x99")], []),
    # first seen with 15 crashes in the last hour (serving and in a reload)
    "first": ([_series("edge_recent_crashes", {"job": "edge", "instance": "first", "phase": p, "window": "1h"},
                       f"_x3 {n}x96") for p, n in (("serving", 12), ("reload", 3))], [(3, 99)]),
    # two crashes in an hour: no loop
    "two": ([_series("edge_recent_crashes", {"job": "edge", "instance": "two", "phase": "serving", "window": "1h"},
                     "0x9 1x9 2x79")], []),
    "gone": ([_series("edge_recent_crashes", {"job": "edge", "instance": "gone", "phase": "serving",
                                              "window": "1h"}, "5x10")], [(0, 10)]),
}
EVAL_MINUTES = (0, 3, 5, 16, 17, 18, 20, 37, 40, 60, 75, 85, 99)


def _value_at(series: list[dict[str, str]], minute: int, alert: str) -> int:
    """The alert's sum at `minute` from the cases' own values (promtool's expansion of a+bxn)."""
    name, keep = (("edge_recent_starts", ("failed", "crashed", "timeout")) if alert == "EdgeStartsFailing"
                  else ("edge_recent_crashes", None))
    total = 0
    for s in series:
        if not s["series"].startswith(name + "{") or (keep and not any(f'result="{r}"' in s["series"] for r in keep)):
            continue
        values: list[str] = []
        for token in s["values"].split():
            v, _, n = token.partition("x")
            values += [v] * (int(n) if v == "_" else int(n) + 1) if n else [v]
        if minute < len(values) and values[minute] != "_":
            total += int(values[minute])
    return total


def _table(alert: str, cases: dict) -> dict:
    """One promtool test: every case's series, and at each of EVAL_MINUTES the alerts that fire
    (the cases whose windows hold that minute), with the count the device reports."""
    series = [s for story, _ in cases.values() for s in story]
    tests = []
    for m in EVAL_MINUTES:
        firing = [(name, story) for name, (story, spans) in sorted(cases.items())
                  if any(a <= m <= b for a, b in spans)]
        tests.append({"eval_time": f"{m}m", "alertname": alert,
                      "exp_alerts": [_fired(alert, name, _value_at(story, m, alert)) for name, story in firing]})
    return {"interval": "1m", "input_series": series, "alert_rule_test": tests}


def test_the_cases_tables_expand_values_as_promtool_does() -> None:
    assert _value_at(STARTS_CASES["loop"][0], 16, "EdgeStartsFailing") == 2
    assert _value_at(STARTS_CASES["loop"][0], 17, "EdgeStartsFailing") == 3
    assert _value_at(STARTS_CASES["boot"][0], 4, "EdgeStartsFailing") == 0
    assert _value_at(STARTS_CASES["boot"][0], 5, "EdgeStartsFailing") == 3
    assert _value_at(STARTS_CASES["mixed"][0], 5, "EdgeStartsFailing") == 3  # ok is no failure
    assert _value_at(CRASHES_CASES["serving"][0], 18, "EdgeCrashLoop") == 3


def test_every_alert_fires_where_it_should_and_nowhere_else(tmp_path: Path) -> None:
    promtool = need("promtool")
    rules = _printed_rules(tmp_path)
    tests = [_start_test(), _alerts_test(), _prompt_cache_test(), _silence_test(),
             _table("EdgeStartsFailing", STARTS_CASES), _table("EdgeCrashLoop", CRASHES_CASES)]
    alerts = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])}
    assert alerts == {"EdgeNotReady", "EdgeStartSlowerThanFleet", "EdgeOtaRolledBack", "EdgeMlockNotTaken",
                      "EdgeModelOnCpu", "EdgePromptCacheHitRateCollapse", "EdgeDeviceSilent",
                      "EdgeStartsFailing", "EdgeSafeMode", "EdgeCrashLoop"}  # every alert of the file
    assert alerts == set(_alert_names(rules.read_text()))
    spec = tmp_path / "edge-rules.test.yml"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}, indent=1))
    r = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_catches_a_wrong_expectation(tmp_path: Path) -> None:
    """The harness can fail: the slow-start case expecting a silent fleet is rejected."""
    promtool = need("promtool")
    rules = _printed_rules(tmp_path)
    case = _start_test()
    case["alert_rule_test"][1]["exp_alerts"] = []
    spec = tmp_path / "wrong.test.yml"
    spec.write_text(json.dumps({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [case]}))
    r = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "EdgeStartSlowerThanFleet" in r.stdout + r.stderr


def _alert_names(text: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("- alert:")]
