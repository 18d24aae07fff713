"""`edge status --svg` and `edge warmup --svg` on real reports: valid SVG (parsed as XML), every
phase and warm-up step drawn, bars to scale, READY / SWITCH / FAILED marked, a reload's old set
drawn serving and draining; rendered by headless Chromium where it is installed."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kit import EDGE, write_config
from edge.fleet.timeline import chart_of, render_svg

SVG = "{http://www.w3.org/2000/svg}"


def _edge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, *args], capture_output=True, text=True, timeout=300)


def _groups(root: ET.Element, attr: str) -> dict[str, list[ET.Element]]:
    out: dict[str, list[ET.Element]] = {}
    for g in root.iter(f"{SVG}g"):
        if attr in g.attrib:
            out.setdefault(g.attrib[attr], []).append(g)
    return out


def _charts(root: ET.Element) -> int:
    return sum(1 for t in root.iter(f"{SVG}text") if (t.text or "").startswith("edge "))


def _check_start(root: ET.Element, report: dict) -> None:
    phases = _groups(root, "data-phase")
    for p in report["phases"]:
        if p["name"] != "ready":
            assert p["name"] in phases, f"phase {p['name']} not drawn"
    steps = _groups(root, "data-step")
    assert sorted(steps) == sorted({s["name"] for s in report["warmup"]})
    # to scale: every bar wider than its 2 px minimum is seconds x one scale
    scales = []
    for p in report["phases"]:
        for g in phases.get(p["name"], []):
            w = float(g.find(f"{SVG}rect").attrib["width"])
            if w > 20:
                scales.append(w / p["seconds"])
    assert scales and max(scales) / min(scales) < 1.02, scales
    titles = " ".join(t.text or "" for t in root.iter(f"{SVG}title"))
    assert "page_in" in titles and "resident_before" in titles  # the detail on hover
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    page_in = next(p for p in report["phases"] if p["name"] == "page_in")
    assert f"{page_in['mb_per_s']:.0f} MB/s" in texts


def test_status_svg_draws_the_start_and_the_reload(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    edge = service(cfg)
    out = tmp_path / "start.svg"
    r = _edge("status", "--config", str(cfg), "--svg", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "state" / "last-start.json").read_text())
    root = ET.parse(out).getroot()
    _check_start(root, report)
    assert set(_groups(root, "data-marker")) == {"ready"}
    r = _edge("reload", "--config", str(write_config(tmp_path / "b.toml", tiny_gguf, n_ctx=512)))
    assert r.returncode == 0, r.stderr
    edge.stop()  # the drain is over and written: the reload report is complete
    r = _edge("status", "--config", str(cfg), "--svg", str(out))
    assert r.returncode == 0, r.stderr
    root = ET.parse(out).getroot()
    assert _charts(root) == 2
    reload = json.loads((tmp_path / "state" / "last-reload.json").read_text())
    phases = _groups(root, "data-phase")
    for p in reload["phases"]:
        if p["name"] != "switch":
            assert p["name"] in phases, f"reload phase {p['name']} not drawn"
    assert "serving" in phases and len(phases["drain"]) == 1  # the old set: serving, then draining
    assert set(_groups(root, "data-marker")) == {"ready", "switch"}


def test_warmup_svg_draws_the_rehearsal(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    out = tmp_path / "rehearsal.svg"
    r = _edge("warmup", "--config", str(cfg), "--json", "--svg", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    root = ET.parse(out).getroot()
    _check_start(root, report)
    assert set(_groups(root, "data-marker")) == {"ready"}  # where READY would have come
    r = _edge("warmup", "--config", str(cfg), "--svg", str(tmp_path / "no" / "such" / "dir.svg"))
    assert r.returncode != 0 and "--svg" in r.stderr and "Traceback" not in r.stderr


def test_failed_start_is_drawn_with_its_error_escaped(tmp_path: Path) -> None:
    report = {"pid": 1, "host": "h", "started_at": "2026-01-01T00:00:00+0000", "edge_version": "0",
              "ready_s": 0.4, "result": "failed", "exit_code": 65, "error": "model <x> & 'y' \"z\"",
              "phases": [{"name": "config", "start_s": 0.1, "seconds": 0.01, "detail": {"path": "<&>"}},
                         {"name": "imports", "start_s": 0.12, "seconds": 0.2, "detail": {}}]}
    root = ET.fromstring(render_svg([chart_of(report)]))
    assert set(_groups(root, "data-marker")) == {"failed"}
    assert any("model <x> & 'y'" in (t.text or "") for t in root.iter(f"{SVG}text"))
    assert set(_groups(root, "data-phase")) == {"config", "imports"}


def test_chromium_renders_it(tmp_path: Path, tiny_gguf: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        reason = "no headless Chromium here (apt install chromium): the SVG was checked as XML only"
        print(reason)
        pytest.skip(reason)
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    svg = tmp_path / "t.svg"
    assert _edge("warmup", "--config", str(cfg), "--svg", str(svg)).returncode == 0
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", svg.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "data-phase" in dom.stdout and "parsererror" not in dom.stdout, dom.stderr[-500:]
    png = tmp_path / "t.png"
    shot = subprocess.run([*base, "--hide-scrollbars", "--window-size=1100,500", f"--screenshot={png}",
                           svg.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0, shot.stderr[-500:]
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1100, 500)
