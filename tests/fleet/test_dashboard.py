"""The Grafana dashboard (`edge fleet dashboard`, edge/fleet/dashboard.py): built by Grafana's own
builders, every panel's query evaluated by a real Prometheus (Debian's) that scraped a real
`edge serve` (with an OTA install, a crash record and the shipped rules loaded) and returning
data; every metric a panel names is one a device exports or a rule records, so renaming a family
fails here."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kit import EDGE
from kit.ota import committed
from kit.prom import Prometheus, need, until

ROOT = Path(__file__).resolve().parents[2]


def _sdk() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="the `dashboard` extra (Python 3.11+) is not installed")


def _exported(text: str) -> set[str]:
    """Every series name an exposition declares, samples or not (a family with nothing to report
    yet, safe mode on a healthy device, is still named)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in text_string_to_metric_families(text)}


def _recorded() -> set[str]:
    return set(re.findall(r"^\s*- record: (\S+)", (ROOT / "edge/fleet/rules/edge-rules.yml").read_text(), re.M))


def unknown_names(known: set[str]) -> list[str]:
    """(panel: name) for every series a panel reads that `known` lacks."""
    from edge.fleet.dashboard import metric_names, panels

    return [f"{p.title}: {name}" for p in panels() for expr, _ in p.targets
            for name in sorted(metric_names(expr) - known)]


def test_the_cli_prints_the_dashboard_and_its_provisioning_file() -> None:
    _sdk()
    from edge.fleet.dashboard import alert_expressions, panels

    r = subprocess.run([*EDGE, "fleet", "dashboard"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    board = json.loads(r.stdout)
    assert board["uid"] == "edge-fleet" and board["templating"]["list"][0]["type"] == "datasource"
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert exprs == [e for p in panels() for e, _ in p.targets]
    text = (ROOT / "edge/fleet/rules/edge-rules.yml").read_text()
    alerts = alert_expressions(text)
    assert [a for a, _ in alerts] == re.findall(r"^\s*- alert: (\S+)", text, re.M) and len(alerts) >= 10
    assert all(any(f"({expr})" in e for e in exprs) for _, expr in alerts)
    assert dict(alerts)["EdgeCrashLoop"] == "max_over_time(edge:recent_crashes_after_ready:1h[30m]) >= 3"
    assert dict(alerts)["EdgeStartsFailing"] == "max_over_time(edge:recent_failed_starts:30m[15m]) >= 3"
    assert dict(alerts)["EdgeGivenUp"] == "edge:given_up"
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in board["panels"])
    r = subprocess.run([*EDGE, "fleet", "dashboard", "--provisioning", "--path", "/srv/dash"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and 'path: "/srv/dash"' in r.stdout and "type: file" in r.stdout, r.stderr


def test_every_panel_lies_inside_grafanas_24_columns_and_none_overlaps() -> None:
    _sdk()
    r = subprocess.run([*EDGE, "fleet", "dashboard"], capture_output=True, text=True, timeout=120)
    board = json.loads(r.stdout)
    cells: dict[tuple[int, int], str] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0 and g["y"] >= 0, (p["title"], g)
        for col in range(g["x"], g["x"] + g["w"]):
            for row in range(g["y"], g["y"] + g["h"]):
                assert (col, row) not in cells, (p["title"], "overlaps", cells.get((col, row)))
                cells[(col, row)] = p["title"]
    titles = [p["title"] for p in board["panels"]]
    assert "Devices given up (answering 503)" in titles and len(titles) == len(set(titles))


def test_a_renamed_metric_is_a_panel_naming_nothing() -> None:
    from edge.fleet.dashboard import metric_names

    names = {n for p in _panels() for e, _ in p.targets for n in metric_names(e)}
    assert {"edge_recent_starts", "edge_crashes_total", "up", "module_model:edge_last_start_ready_seconds:p95"} <= names
    assert metric_names('edge_ota_info{current="edge_fake"} or on() vector(0)') == {"edge_ota_info"}
    assert unknown_names(names) == []
    assert unknown_names(names - {"edge_recent_starts"}) == [
        "Starts in the last 30 minutes by result: edge_recent_starts"]
    assert unknown_names(names - {"edge:recent_failed_starts:30m"}) == [  # the alert reads the rule's record
        "Alert EdgeStartsFailing: edge:recent_failed_starts:30m"]


def _panels():
    from edge.fleet.dashboard import panels

    return panels()


def _seed_crash(state: Path) -> None:
    from edge.fleet.history import CRASH
    from edge.timing import write_report

    write_report({"started_unix": time.time() - 60, "ready_s": 30.0, "pid": 4242, "phase": "serving",
                  "signal": "SEGV", "result": "crashed"}, state, kind=CRASH)


def test_every_panel_returns_data_from_prometheus_over_a_real_edge(kit, tiny_gguf: Path, service, tmp_path: Path) -> None:
    _sdk()
    need("prometheus")
    from kit import write_config

    committed(kit, "A")  # the device's OTA state: the same state dir as the served config's
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    _seed_crash(tmp_path / "state")
    edge = service(cfg)
    with urllib.request.urlopen(f"http://127.0.0.1:{edge.address[1]}/metrics", timeout=30) as r:
        exported = _exported(r.read().decode())
    assert unknown_names(exported | _recorded() | {"up"}) == []  # a renamed family fails here
    rules = tmp_path / "prom" / "edge-rules.yml"
    rules.parent.mkdir()
    rules.write_text((ROOT / "edge/fleet/rules/edge-rules.yml").read_text())
    prom = Prometheus(tmp_path / "prom", json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "edge", "static_configs": [
            {"targets": [f"127.0.0.1:{edge.address[1]}"], "labels": {"instance": "dev1"}}]}]}))
    try:
        # the rules evaluated over at least two scrapes (a rate needs two samples)
        until("the recording rules", lambda: prom.query("edge:prompt_cache_hit_ratio:rate15m") or None, 120,
              prom.proc, prom.log)
        until("the fleet p95", lambda: prom.query("module_model:edge_last_start_ready_seconds:p95") or None, 60,
              prom.proc, prom.log)
        empty = [f"{p.title}: {expr}" for p in _panels() for expr, _ in p.targets if not prom.query(expr)]
        assert empty == []
        crashes = prom.query("sum by (phase, signal) (edge_crashes_total)")
        assert [(c["metric"], c["value"][1]) for c in crashes] == [({"phase": "serving", "signal": "SEGV"}, "1")]
        ota = prom.query("count by (current, highest) (edge_ota_info)")
        assert ota[0]["metric"] == {"current": "1.0.0", "highest": "1.0.0"}
        version = prom.query('quantile by (module, version) (0.5, edge_last_start_seconds{phase="ready"} * on(job, '
                             'instance) group_left(module) edge_device_info * on(job, instance) group_left(version) '
                             'edge_build_info)')
        from edge import __version__

        assert version[0]["metric"]["version"] == __version__ and float(version[0]["value"][1]) > 0
    finally:
        prom.close()
