"""The Prometheus rules shipped with edge (edge/fleet/rules/edge-rules.yml, `edge fleet rules`): in the
wheel, valid for `promtool check rules`, and unit-tested with `promtool test rules`: input series
for every alert, which must fire where it should and stay silent where it should not, and the
fleet's p50/p95 ready time by module and model computed from known values.

The health alerts are tables of stories (tests/kit/rulecases.py) checked at every minute of 150: a
mixed fleet (new devices' gauges, old devices' lifetime counters only, both in one fleet), scrape
gaps (stale markers) and push gaps of 1, 5 and 15 minutes, flapping scrapes, two devices of one
hostname, crash loops every 15, 18, 20, 22 and 25 minutes fed through edge's own crash records
and history (and one every 35, which is no loop), and a given-up device from the give-up
server's own /metrics."""

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
from kit.rulecases import Case, alert_table, crash_loop_values, expand, gap, scraped

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
    wheel = next((tmp_path / "dist").glob("edge_coldstart-*.whl"))
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


def _crashes(instance: str, values: str, phase: str = "serving") -> dict[str, str]:
    return _series("edge_recent_crashes", {"job": "edge", "instance": instance, "phase": phase, "window": "1h"},
                   values)


def _crashes_total(instance: str, values: str, phase: str = "serving") -> dict[str, str]:
    return _series("edge_crashes_total", {"job": "edge", "instance": instance, "phase": phase, "signal": "SEGV",
                                          "cause": "native-fault"}, values)


MINUTES = 150  # every table is evaluated at each of these minutes: a one-minute flicker fails it
END = MINUTES - 1
# a restart loop's gauge: 1, 2, 3 failures (3 from minute 17 to 80), then none again
LOOP = expand("0x4 1x5 2x5 3x63 0x68")
# held: 20 minutes on what a device last said (last_over_time) + 15 of max_over_time after 3 was last seen
LOOP_FIRES = [(17, 95)]


def _gapped(name: str, values: list[str]) -> str:
    """`values` with the gap the case's name says: gap-<minutes>-<scrape|push>, from minute 40."""
    _, minutes, how = name.split("-")
    return gap(values, 40, int(minutes), how)


def _starts_cases() -> dict[str, Case]:
    """New devices (edge_recent_starts), old ones (only edge_starts_total), gaps and flapping."""
    cases = {
        "loop": Case([_recent("loop", "failed", " ".join(LOOP)), _total("loop", "failed", "0x4 1x5 2x5 3x132")],
                     LOOP_FIRES),
        # lifetime failed=5 long ago; offline for an hour (no samples), back with nothing new
        "back": Case([_recent("back", "failed", "0x10 _x60 0x78"), _total("back", "failed", "5x10 _x60 5x78")]),
        # a fleet Prometheus that has just started, over a device with failed=4, stopped=6 from before
        "fresh": Case([_recent("fresh", "failed", "0x149"), _recent("fresh", "stopped", "0x149"),
                       _total("fresh", "failed", "4x149"), _total("fresh", "stopped", "6x149")]),
        # history.json damaged and recounted from the reports on disk: 10 -> 4 (a counter reset to
        # the counters' fallback, never used where the gauge is); a state dir wiped: 7 -> 0
        "recount": Case([_recent("recount", "failed", "0x149"), _total("recount", "failed", "10x10 4x138")]),
        "reset": Case([_recent("reset", "failed", "0x149"), _total("reset", "failed", "7x10 0x138")]),
        # an operator stops the service 4 times in 20 minutes: no start failed
        "stops": Case([_recent("stops", "stopped", "1 2 3 4x146"), _recent("stops", "failed", "0x149")]),
        # a boot loop from the first scrape, and one of crashed and timed-out starts
        "boot": Case([_recent("boot", "failed", "_x5 3x144")], [(5, END)]),
        "mixed": Case([_recent("mixed", "crashed", "_x5 2x144"), _recent("mixed", "timeout", "_x5 1x144"),
                       _recent("mixed", "ok", "_x5 9x144")], [(5, END)]),
        # a device removed from the fleet while it failed: held 20 + 5 (lookback) + 15 minutes after
        "gone": Case([_recent("gone", "failed", "3x10")], [(0, 50)]),
        # a restart loop that fails every 12 minutes: 2 or 3 in any 30; fires steadily
        "every12": Case([_recent("every12", "failed", " ".join(
            str(sum(1 for f in range(12, 150, 12) if m - 30 < f <= m)) for m in range(MINUTES)))],
            [(36, END)]),
        # flapping: every other scrape fails (a stale marker each time) during the loop
        "flapping": Case([_recent("flapping", "failed", " ".join(
            "stale" if 17 < m <= 80 and m % 2 else v for m, v in enumerate(LOOP)))], LOOP_FIRES),
        # old devices: an edge before the gauges, only the lifetime counter
        "old-loop": Case([_total("old-loop", "failed", "0x4 1x5 2x5 3x132")], [(17, 49)]),
        "old-quiet": Case([_total("old-quiet", "failed", "9x149"), _total("old-quiet", "crashed", "4x149")]),
        "old-back": Case([_total("old-back", "failed", "5x10 _x60 5x78")]),
        # two devices flashed from one image (one hostname): the agent names each by its machine id
        "3f1c0a9e51d04d8ba6b0a3ef5e2a7c41": Case([_recent("3f1c0a9e51d04d8ba6b0a3ef5e2a7c41", "failed",
                                                           " ".join(LOOP))], LOOP_FIRES),
        "8b27d4c3e9f14a05b1d6c7e8f9a0b1c2": Case([_recent("8b27d4c3e9f14a05b1d6c7e8f9a0b1c2", "failed", "0x149")]),
    }
    for n in (1, 5, 15):  # a loop whose scrapes fail, or whose pushes stop, for n minutes from minute 40
        for how in ("scrape", "push"):
            name = f"gap-{n}-{how}"
            cases[name] = Case([_recent(name, "failed", _gapped(name, LOOP))], LOOP_FIRES)
    return cases


def _crash_cases(tmp_path: Path) -> dict[str, Case]:
    """Crash loops of 15 to 25 minutes fed through edge's own history (crash records dated by
    ExecStopPost=, counted by the ledger), and the stories of the gauge and of old devices."""
    cases = {}
    for period in (15, 18, 20, 22, 25, 35):  # 35: under 3 an hour, never a loop
        values = crash_loop_values(tmp_path / f"period-{period}", period, MINUTES)
        # the device's own count: 3 (or more) at each crash, never under 2 once the loop runs
        assert (max(values) >= 3) == (period <= 25)
        assert period > 25 or min(values[3 * period:]) >= 2
        cases[f"period-{period}"] = Case([_crashes(f"period-{period}", " ".join(map(str, values)))],
                                         [(3 * period, END)] if period <= 25 else [])
    serving = expand(" ".join(f"{k}x5" for k in range(10)) + " 10x89")  # every 6 minutes
    cases.update({
        "serving": Case([_crashes("serving", " ".join(serving))], [(18, END)]),
        # first seen with 15 crashes in its lifetime, none in the last hour
        "old-lifetime": Case([_crashes_total("old-lifetime", "15x149"), _crashes("old-lifetime", "0x149")]),
        # first seen with 15 crashes in the last hour (serving and in a reload)
        "first": Case([_crashes("first", "_x3 12x146"), _crashes("first", "_x3 3x146", phase="reload")], [(3, END)]),
        "two": Case([_crashes("two", "0x9 1x9 2x129")]),
        "gone": Case([_crashes("gone", "5x10")], [(0, 65)]),  # 10, + 20 held, + 5 lookback, + 30
        "flapping": Case([_crashes("flapping", " ".join("stale" if m > 18 and m % 2 else v
                                                          for m, v in enumerate(serving)))], [(18, END)]),
        # an old device: a crash every 20 minutes while serving, counted by its lifetime counters only;
        # a crashed start (before READY) at 30 is one crash and one crashed start: not after READY
        "old-loop": Case([_crashes_total("old-loop", " ".join(str(m // 20 + (m >= 30)) for m in range(MINUTES))),
                          _total("old-loop", "crashed", "0x29 1x119")], [(60, END)]),
    })
    for n in (1, 5, 15):
        for how in ("scrape", "push"):
            name = f"gap-{n}-{how}"
            cases[name] = Case([_crashes(name, _gapped(name, serving))], [(18, END)])
    return cases


def _given_up_exposition(tmp_path: Path, tiny_gguf: Path) -> str:
    """What a given-up device's /metrics answers (edge.lifecycle.unavailable, its own code)."""
    from edge.config import load
    from edge.fleet.giveup import GiveUp
    from edge.lifecycle.systemd import Notifier
    from edge.lifecycle.unavailable import Unavailable
    from kit import write_config

    cfg = load(str(write_config(tmp_path / "edge.toml", tiny_gguf)))
    crash = {"at": "2026-12-01T10:00:00+0000", "pid": 9, "phase": "warmup", "model": "tiny", "signal": "SEGV",
             "cause": "native-fault", "record": "crash-1.json"}
    give_up = GiveUp.begin("safe mode exhausted: phase warmup (tiny) crashed again (SIGSEGV)", [crash],
                           {"config": "c", "keys": "k", "edge": "0"}, 600.0, None)
    (tmp_path / "state").mkdir(exist_ok=True)
    give_up.save(tmp_path / "state")
    return Unavailable(give_up, cfg, Notifier(), dict)._metrics().decode()


SERVING = 'edge_ready 1\nedge_build_info{version="0.1.0"} 1\n'  # a device serving normally
GAVE_UP = {"phase": "warmup", "signal": "SEGV", "target": "tiny"}


def _given_up_cases(tmp_path: Path, tiny_gguf: Path) -> dict[str, dict[str, Case]]:
    """Per alert: a given-up device (its scrapes failing for 10 minutes, then pushing nothing for
    15), given up until minute 70, then serving; a device that serves throughout."""
    gave_up = _given_up_exposition(tmp_path, tiny_gguf)
    story = scraped("given-up", [(gave_up, 30, ""), (None, 10, "scrape"), (gave_up, 15, ""), (None, 15, "push"),
                                 (gave_up, 0, ""), (SERVING, 80, "")])
    fine = scraped("serving", [(SERVING, MINUTES, "")])
    return {"EdgeGivenUp": {"given-up": Case(story, [(0, 69)], GAVE_UP), "serving": Case(fine)},
            "EdgeNotReady": {"given-up": Case(story), "serving": Case(fine)},
            "EdgeDeviceSilent": {"given-up": Case(story), "serving": Case(fine)}}


def _not_ready_cases() -> dict[str, Case]:
    """EdgeNotReady on a real network: flapping scrapes of a ready device are not a device that is
    not ready; a device not ready stays so across a push gap."""
    return {
        "flapping-ready": Case([_series("edge_ready", {"job": "edge", "instance": "flapping-ready"},
                                        " ".join("stale" if m % 2 else "1" for m in range(MINUTES))),
                                _series("up", {"job": "edge", "instance": "flapping-ready"},
                                        " ".join(str(1 - m % 2) for m in range(MINUTES)))]),
        "flapping-not-ready": Case([_series("edge_ready", {"job": "edge", "instance": "flapping-not-ready"},
                                            " ".join("stale" if m % 2 else "0" for m in range(MINUTES))),
                                    _series("up", {"job": "edge", "instance": "flapping-not-ready"},
                                            " ".join(str(1 - m % 2) for m in range(MINUTES)))], [(10, END)]),
        "push-gap": Case([_series("edge_ready", {"job": "edge", "instance": "push-gap"}, "0x30 _x14 0x104"),
                          _series("up", {"job": "edge", "instance": "push-gap"}, "1x30 _x14 1x104")], [(10, END)]),
    }


def test_the_cases_expand_values_as_promtool_does() -> None:
    assert expand("0x4 1x5") == ["0"] * 5 + ["1"] * 6 and expand("_x3 2") == ["_", "_", "_", "2"]
    assert expand("1+2x3") == ["1", "3", "5", "7"] and len(LOOP) == MINUTES
    assert gap(["3"] * 6, 2, 3, "scrape") == "3 3 stale _ _ 3" and gap(["3"] * 6, 2, 3, "push") == "3 3 _ _ _ 3"


def test_every_alert_fires_where_it_should_and_nowhere_else(tmp_path: Path, tiny_gguf: Path) -> None:
    """Each table: every minute of MINUTES, the firing set exactly (a one-minute flicker fails)."""
    promtool = need("promtool")
    rules = _printed_rules(tmp_path)
    given_up = _given_up_cases(tmp_path, tiny_gguf)
    tables = [("EdgeStartsFailing", _starts_cases()), ("EdgeCrashLoop", _crash_cases(tmp_path)),
              ("EdgeNotReady", {**_not_ready_cases(), **given_up["EdgeNotReady"]}),
              ("EdgeGivenUp", given_up["EdgeGivenUp"]), ("EdgeDeviceSilent", given_up["EdgeDeviceSilent"])]
    tests = [_start_test(), _alerts_test(), _prompt_cache_test(), _silence_test(), _annotated_test()]
    tests += [alert_table(alert, cases, MINUTES) for alert, cases in tables]
    alerts = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])} | {a for a, _ in tables}
    assert alerts == set(_alert_names(rules.read_text()))  # every alert of the file
    spec = tmp_path / "edge-rules.test.yml"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}, indent=1))
    r = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]


def _annotated_test() -> dict:
    """The summary and description of the three health alerts, with the count they show."""
    gave_up = {"job": "edge", "instance": "g", **GAVE_UP}
    return {"interval": "1m", "input_series": [
        _recent("loop", "failed", " ".join(LOOP)), _crashes("crashes", "0x9 3x30"),
        _series("edge_given_up", gave_up, "1x30"), _series("edge_build_info", {"job": "edge", "instance": "g"}, "1x30")],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "EdgeStartsFailing", "exp_alerts": [_fired("EdgeStartsFailing", "loop", 3)]},
            {"eval_time": "20m", "alertname": "EdgeCrashLoop", "exp_alerts": [_fired("EdgeCrashLoop", "crashes", 3)]},
            {"eval_time": "20m", "alertname": "EdgeGivenUp", "exp_alerts": [{
                "exp_labels": {**gave_up, "severity": "critical"},
                "exp_annotations": {"summary": "edge on g has given up: warmup crashed with SIGSEGV (tiny) on every "
                                               "safe fallback",
                                    "description": "It answers every request 503 until `edge safe-mode clear`, "
                                                   "another config, model, llama.cpp or edge, or its retry "
                                                   "(edge_given_up_retry_timestamp_seconds). `edge status` on the "
                                                   "device lists the crashes."}}]}]}


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
