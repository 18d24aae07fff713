"""Input series for `promtool test rules` (tests/fleet/test_rules.py): a fleet's stories written
one minute a value, and the alert expected at every minute of them.

A story is a case: its series (what one device, or two, reported: `_` no sample, `stale` a failed
scrape's stale marker, promtool's `axN` expansion) and the minutes (inclusive spans) its alert
fires. `alert_table` turns cases into one promtool test that checks the firing set at every
minute (`ALERTS{alertstate="firing"}`), so a flicker of one minute anywhere is a failure.

Two kinds of series come from edge's own code, not from a hand-written table: a crash loop's
`edge_recent_crashes`, crash records made by edge.fleet.crashes (dated by systemd's word) and
counted by edge.fleet.history's ledger at each minute; and a given-up device's whole exposition,
what edge.lifecycle.unavailable's /metrics answers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Case", "alert_table", "crash_loop_values", "expand", "gap", "scraped", "series"]


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "}",
            "values": values}


def expand(values: str) -> list[str]:
    """promtool's notation, one value a minute: `3x4` is 5 samples, `1+2x3` 1 3 5 7, `_x4` 4 gaps."""
    out: list[str] = []
    for token in values.split():
        v, _, n = token.partition("x")
        if not n:
            out.append(v)
        elif v in ("_", "stale"):
            out += [v] * int(n)
        else:
            start, _, step = v.partition("+")
            out += [_num(float(start) + float(step or 0) * i) for i in range(int(n) + 1)]
    return out


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)


def gap(values: list[str], start: int, minutes: int, how: str) -> str:
    """`values` with `minutes` of them from `start` lost: "scrape" (the target did not answer: a
    stale marker, then nothing) or "push" (the uplink was down: nothing at all)."""
    lost = ["stale"] + ["_"] * (minutes - 1) if how == "scrape" else ["_"] * minutes
    return " ".join(values[:start] + lost + values[start + minutes:])


@dataclass
class Case:
    """One device's story (or a few), and when the alert fires: inclusive minute spans."""

    series: list[dict[str, str]]
    firing: list[tuple[int, int]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # the alert's own labels beyond job and instance

    def fires_at(self, minute: int) -> bool:
        return any(a <= minute <= b for a, b in self.firing)


def alert_table(alert: str, cases: dict[str, Case], minutes: int, severity: str = "critical") -> dict:
    """One promtool test: every case's series (each case's instance is its name), and at every
    minute the firing alerts, exactly."""
    tests = []
    for m in range(minutes):
        firing = sorted(name for name, case in cases.items() if case.fires_at(m))
        tests.append({"expr": f'ALERTS{{alertname="{alert}", alertstate="firing"}}', "eval_time": f"{m}m",
                      "exp_samples": [{"labels": series("ALERTS", {
                          "alertname": alert, "alertstate": "firing", "instance": n, "job": "edge",
                          "severity": severity, **cases[n].labels}, "")["series"], "value": 1} for n in firing]})
    return {"interval": "1m", "input_series": [s for c in cases.values() for s in c.series],
            "promql_expr_test": tests}


def crash_loop_values(state: Path, period_min: int, minutes: int, restart_s: float = 3.0) -> list[int]:
    """A service that crashes while serving every `period_min` minutes (first at period_min), each
    crash recorded as ExecStopPost= records it, then what the device's edge_recent_crashes{window=
    "1h"} reads at each minute: its history ledger's count, by when each crash happened."""
    from edge.fleet.crashes import settle
    from edge.fleet.history import Ledger
    from edge.fleet.journal import JournalRead, Stop
    from edge.fleet.metrics import CRASHES_WINDOW

    base = float(int(time.time()) - (minutes + 90) * 60)  # whole seconds (records keep ms), within the ledger's 24 h
    (state / "journal").mkdir(parents=True, exist_ok=True)
    for k in range(1, minutes // period_min + 1):
        crashed = base + k * period_min * 60
        started = crashed - period_min * 60 + restart_s  # Restart= after the crash before it
        head = {"journal": 1, "pid": 1000 + k, "started_unix": started,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))}
        j = JournalRead(state / "journal" / f"{1000 + k}-1.jsonl", head, ready=2.5, healthy=True, last_t=302.5,
                        stop=Stop("core-dump", "dumped", "SEGV", at=crashed))
        settle(state, j)
    ledger = Ledger(state)
    ledger.update()
    window = CRASHES_WINDOW[1]
    return [sum(ledger.recent(window, now=base + m * 60).get("after_ready", {}).values()) for m in range(minutes)]


def _samples(text: str) -> dict[str, str]:
    """series key (name and labels, job and instance to come) -> value, of a /metrics answer."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):  # a counter's creation time: no rule reads it
                out[json.dumps([s.name, sorted(s.labels.items())])] = _num(float(s.value))
    return out


def scraped(instance: str, segments: list[tuple[str | None, int, str]]) -> list[dict[str, str]]:
    """A device's series as Prometheus stores them, minute by minute: `segments` are (its /metrics
    answer, minutes, "") while it answers, and (None, minutes, "scrape" or "push") while it does
    not (a failed scrape: `up` 0 and a stale marker on every series; a push gap: nothing at all).
    A series an answer no longer has gets its stale marker then, as after a real scrape."""
    keys: dict[str, list[str]] = {}
    up: list[str] = []
    minute = 0
    for text, minutes, how in segments:
        now = _samples(text) if text is not None else {}
        for key in now:
            keys.setdefault(key, ["_"] * minute)
        for key, values in keys.items():
            if key in now:
                values += [now[key]] * minutes
            elif how == "push":
                values += ["_"] * minutes
            else:  # gone from the answer, or the answer failed: stale once, then nothing
                values += (["stale"] if values and values[-1] not in ("_", "stale") else ["_"]) + ["_"] * (minutes - 1)
        up += (["1" if text is not None else "0"] if how != "push" else ["_"]) * minutes
        minute += minutes
    labels = {"job": "edge", "instance": instance}
    out = [series("up", labels, " ".join(up))]
    for key, values in keys.items():
        name, pairs = json.loads(key)
        out.append(series(name, {**labels, **dict(pairs)}, " ".join(values)))
    return out
