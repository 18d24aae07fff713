"""The fleet's Grafana dashboard (`edge fleet dashboard > edge.json`) and the provisioning file
that loads it (`edge fleet dashboard --provisioning`), built with Grafana's own typed builders
(grafana-foundation-sdk, the `dashboard` extra, imported only here and only when called).

Every panel's query names only what edge exports (edge.fleet.metrics, edge.serve.metrics) and
what the shipped rules record (rules/edge-rules.yml), and returns data on a working fleet: a
count that is zero while nothing is wrong says 0 (`or on() vector(0)`), never "No data".
tests/fleet/test_dashboard.py evaluates each query against a real Prometheus that scraped a real
`edge serve`, and fails on a metric name no device or rule has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Panel", "alert_expressions", "dashboard_json", "grid", "metric_names", "panels", "provisioning"]

UID = "edge-fleet"
ZERO = " or on() vector(0)"  # nothing wrong: the panel says 0, not "No data"
# the last start's exec-to-READY time with the device's module and the build's edge version
READY = ('edge_last_start_seconds{phase="ready"} * on(job, instance) group_left(module) edge_device_info'
         ' * on(job, instance) group_left(version) edge_build_info')
SILENT = 'max by (job, instance) (max_over_time(edge_ready[1d])) unless on(job, instance) edge_ready'


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | table
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


def _fixed_panels() -> list[Panel]:
    p50, p95 = "module_model:edge_last_start_ready_seconds:p50", "module_model:edge_last_start_ready_seconds:p95"
    return [
        Panel("Time to READY: fleet P50 / P95 by module and model", "timeseries", "s",
              ((p50, "p50 {{module}} · {{model}}"), (p95, "p95 {{module}} · {{model}}")),
              "The shipped recording rules: the last start's exec-to-READY time of every device."),
        Panel("Time to READY: fleet P50 / P95 by module and edge version", "timeseries", "s",
              ((f"quantile by (module, version) (0.5, {READY})", "p50 {{module}} · edge {{version}}"),
               (f"quantile by (module, version) (0.95, {READY})", "p95 {{module}} · edge {{version}}"))),
        Panel("Starts in the last 30 minutes by result", "timeseries", "short",
              (('sum by (result) (edge_recent_starts{window="30m"})', "{{result}}"),),
              "Counted on each device from its history: stopped is an operator's."),
        Panel("Crashes by phase and signal", "table", "short",
              (("sum by (phase, signal) (edge_crashes_total)" + ZERO, "{{phase}} · {{signal}}"),
               ('sum by (instance, phase) (edge_recent_crashes{window="1h"})', "last hour: {{instance}} · {{phase}}")),
              "Lifetime counts by phase and signal; crashes after READY in the last hour per device."),
        Panel("Safe mode in force", "table", "short",
              (("max by (instance, phase, target, reason) (edge_safe_mode_info)" + ZERO,
                "{{instance}} · {{target}}: {{reason}}"),)),
        Panel("OTA versions", "table", "short",
              (("count by (current, highest) (edge_ota_info)" + ZERO, "{{current}} (highest {{highest}})"),)),
        Panel("OTA last results", "table", "short",
              (("count by (result, version) (edge_ota_last_result == 1)" + ZERO, "{{result}} · {{version}}"),)),
        Panel("Models not locked in memory (mlock failures)", "stat", "short",
              (("sum(1 - edge_mlock_ok)" + ZERO, "not locked"),)),
        Panel("Devices not scraped, silent or given up", "stat", "short",
              (('count(up{job="edge"} == 0)' + ZERO, "not scraped"), (f"count({SILENT})" + ZERO, "silent"),
               ("count(edge:given_up)" + ZERO, "given up"))),
        Panel("Devices given up (answering 503)", "table", "short",
              (("max by (instance, phase, signal, target) (edge:given_up)" + ZERO,
                "{{instance}} · {{phase}} SIG{{signal}} · {{target}}"),),
              "Safe mode exhausted: every request is answered 503 until `edge safe-mode clear`, another config, "
              "model, llama.cpp or edge, or the retry (the shipped rule edge:given_up, EdgeGivenUp)."),
    ]


def alert_expressions(rules: str) -> list[tuple[str, str]]:
    """(alert, expr) of every alert in the rules file's text (its own layout: `- alert:` then an
    `expr:` on one line or as a `|` block)."""
    found: list[tuple[str, str]] = []
    lines = rules.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*- alert: (\S+)", line)
        if not m:
            continue
        expr_line = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("expr:"))
        head = lines[expr_line].split("expr:", 1)[1].strip()
        if head != "|":
            found.append((m[1], head))
            continue
        indent = len(lines[expr_line]) - len(lines[expr_line].lstrip())
        block = []
        for body in lines[expr_line + 1:]:
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break
            block.append(body.strip())
        found.append((m[1], " ".join(b for b in block if b)))
    return found


def panels() -> list[Panel]:
    """The fixed panels, then one per shipped alert: its own expression (0 while it does not fire)."""
    from edge.fleet.agent import rules_text

    return _fixed_panels() + [
        Panel(f"Alert {name}", "timeseries", "short", ((f"({expr})" + ZERO, "{{instance}}"),),
              f"The alert's own expression: {expr}") for name, expr in alert_expressions(rules_text())]


def metric_names(expr: str) -> set[str]:
    """The series a query reads: edge's families, the rules' records, `up` (label values in
    quotes are not names)."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"(?<![\w:])(?:edge_\w+|edge:[\w:]+|module_model:[\w:]+|up)(?![\w:(])", bare))


COLUMNS, HEIGHT = 24, 8  # Grafana's grid: 24 columns; every panel 8 rows high


def grid(panels: list[Panel]) -> list[tuple[int, int, int, int]]:
    """(x, y, w, h) of each panel: tables the full width, the others half, filled left to right
    and wrapped to the next row before a panel would cross the 24th column (the SDK's builder
    wraps only after one did)."""
    out, x, y = [], 0, 0
    for p in panels:
        w = COLUMNS if p.kind == "table" else COLUMNS // 2
        if x + w > COLUMNS:
            x, y = 0, y + HEIGHT
        out.append((x, y, w, HEIGHT))
        x += w
    return out


def _builder(panel: Panel, at: tuple[int, int, int, int]) -> Any:
    from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

    kind = {"timeseries": timeseries, "stat": stat, "table": table}[panel.kind]
    x, y, w, h = at
    b = (kind.Panel().title(panel.title).unit(panel.unit).grid_pos(GridPos(h=h, w=w, x=x, y=y))
         .datasource(DataSourceRef(type_val="prometheus", uid="${datasource}")))
    if panel.description:
        b = b.description(panel.description)
    for i, (expr, legend) in enumerate(panel.targets):
        b = b.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)))
    return b


def dashboard_json() -> str:
    """The dashboard as Grafana imports it (JSON), every panel a typed builder's."""
    from edge.errors import require

    require("grafana_foundation_sdk", "dashboard", "building the Grafana dashboard (edge fleet dashboard; "
            "the SDK needs Python 3.11 or newer: run it on any host, not the device)", package="grafana-foundation-sdk")
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    board = (Dashboard("edge fleet").uid(UID).tags(["edge"]).refresh("1m").time("now-6h", "now")
             .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    shown = panels()
    for panel, at in zip(shown, grid(shown)):
        board = board.with_panel(_builder(panel, at))
    return json.dumps(board.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def provisioning(path: str) -> str:
    """Grafana's dashboard provider (provisioning/dashboards/edge.yaml): the folder holding edge.json."""
    return (f"# Grafana dashboard provisioning: put edge.json (`edge fleet dashboard`) in {path}\n"
            "apiVersion: 1\nproviders:\n  - name: edge\n    folder: edge\n    type: file\n"
            "    disableDeletion: false\n    allowUiUpdates: false\n    updateIntervalSeconds: 60\n"
            f"    options:\n      path: {json.dumps(path)}\n      foldersFromFilesStructure: false\n")
