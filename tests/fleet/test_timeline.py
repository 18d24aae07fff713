"""`edge status --svg` and `edge warmup --svg` on real reports: valid SVG (parsed as XML), every
phase and warm-up step drawn, bars to scale, READY / SWITCH / FAILED marked, a reload's old set
drawn serving and draining; laid out by headless Chromium where it is installed (every text box
inside the canvas and none over another, by the browser's own getBBox), and rendered to PNG."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kit import EDGE, write_config
from kit.browser import chromium, layout, overlaps, png_size, render_png
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


LONG = "gemma-3-270m-it-qat-q4_0-unquantized-with-a-name-longer-than-a-lane-label"


def _hostile(rehearsal: dict) -> list[tuple[dict, str]]:
    """A real rehearsal's report made as hard to lay out as a device can make it: a long host
    and model name, 24 warm-up steps too short for their labels, a reload whose SWITCH is at the
    left edge and whose kept/loaded lists and config path are long, READY and FAILED at the right
    edge, and a failed start whose error is 2,800 characters with a 400-character path."""
    start = json.loads(json.dumps(rehearsal).replace('"tiny"', json.dumps(LONG)))
    start.update(host="edge-" + "device" * 14, rehearsal=False)
    start["phases"].append({"name": "ready", "start_s": start["ready_s"], "seconds": 0.0, "detail": {}})
    warm = next(p for p in start["phases"] if p["name"] == "warmup")
    warm["detail"]["steps"] = [{"name": f"step{i}", "seconds": 0.004, "path": "/v1/completions"} for i in range(24)]
    reload = {"started_at": start["started_at"], "pid": start["pid"], "mode": "in-process", "kept": [LONG] * 3,
              "loaded": [LONG + "-b"], "config": "/var/lib/edge/ota/versions/2026.12.2-rc.1/" + "deep/" * 30 + "edge.toml",
              "switch_s": 0.002, "ready_s": 1.5,
              "phases": [{"name": "memory_guard", "start_s": 0.0, "seconds": 0.001, "detail": {}},
                         {"name": "switch", "start_s": 0.002, "seconds": 0.0, "detail": {}},
                         {"name": "drain", "start_s": 0.002, "seconds": 1.4, "detail": {}}]}
    path = "/var/lib/edge/ota/versions/2026.12.2-rc.1/models/" + "x" * 400 + ".gguf"
    failed = {**start, "result": "failed", "exit_code": 65, "ready_s": start["ready_s"],
              "error": f"{path}: not a GGUF file: " + "expected magic b'GGUF', found something else. " * 60}
    failed["phases"] = [p for p in start["phases"] if p["name"] not in ("warmup", "ready")]
    return [(start, "start"), (reload, "reload"), (failed, "start")]


def _laid_out(svg: Path, tmp_path: Path) -> None:
    """In Chromium: every text box inside the canvas, none over another; and a PNG of it."""
    width, height, boxes = layout(svg, tmp_path)
    assert len(boxes) > 10
    outside = [b for b in boxes if not b.inside(width, height)]
    assert outside == [], outside
    assert overlaps(boxes) == []
    png = render_png(svg, tmp_path / f"{svg.stem}.png", int(width), int(height))
    assert png_size(png) == (int(width), int(height))


def test_chromium_lays_out_a_failed_start_and_a_hostile_report_without_overlaps(tmp_path: Path, tiny_gguf: Path) -> None:
    chromium()  # skips, saying why, where there is no browser
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    r = _edge("warmup", "--config", str(cfg), "--json", "--svg", str(tmp_path / "rehearsal.svg"))
    assert r.returncode == 0, r.stderr
    _laid_out(tmp_path / "rehearsal.svg", tmp_path)
    hostile = tmp_path / "hostile.svg"
    hostile.write_text(render_svg([chart_of(rep, kind) for rep, kind in _hostile(json.loads(r.stdout))]))
    _laid_out(hostile, tmp_path)
    root = ET.parse(hostile).getroot()
    error = next(g for g in root.iter(f"{SVG}g") if g.get("data-error"))
    assert "x" * 400 in error.find(f"{SVG}title").text  # the whole message on hover
    assert len(error.findall(f"{SVG}text")) == 6 and error.findall(f"{SVG}text")[-1].text.endswith("…")
    # a real failed start, as `edge status --svg` draws it
    (tmp_path / "bad.gguf").write_bytes(b"not a GGUF file at all" * 100)
    bad = write_config(tmp_path / "bad.toml", tmp_path / "bad.gguf")
    assert _edge("serve", "--config", str(bad)).returncode == 65
    r = _edge("status", "--config", str(bad), "--svg", str(tmp_path / "failed.svg"))
    assert r.returncode == 0, r.stderr
    _laid_out(tmp_path / "failed.svg", tmp_path)


# -- how a start ended, crashes and safe mode, bidirectional controls (issue 45) ------------------
RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: what follows it is drawn backwards
HOSTILE = f"gemma{RLO}fuggg.exe"


def _iso(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(t))


@pytest.mark.parametrize("result, marker, said", [("crashed", "crashed", "killed by signal SEGV after 0.930 s"),
                                                  ("timeout", "timeout", "TimeoutStartSec= after 0.930 s"),
                                                  ("stopped", "stopped", "stopped (SIGTERM) before it was ready")])
def test_a_start_that_did_not_reach_ready_is_never_drawn_ready(result: str, marker: str, said: str) -> None:
    report = {"pid": 1, "host": "h", "started_at": "2026-01-01T00:00:00+0000", "edge_version": "0",
              "ready_s": 0.93, "result": result, "signal": "SEGV",
              "phases": [{"name": "config", "start_s": 0.1, "seconds": 0.01, "detail": {}},
                         {"name": "model_load", "start_s": 0.12, "seconds": 0.8, "detail": {"model": "m"}}]}
    root = ET.fromstring(render_svg([chart_of(report)]))
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "ready after" not in texts and "READY" not in texts and said in texts, texts  # no READY line
    assert set(_groups(root, "data-marker")) == {marker}


def _crash_story(state: Path) -> float:
    """What a device in trouble leaves: a start that crashed in its model load, three crashes
    while serving six minutes apart, safe mode in force since; names with U+202E in them."""
    import time

    from edge.fleet.history import CRASH, FAILED_START
    from edge.lifecycle.safemode import Fallback, SafeMode
    from edge.timing import write_report

    now = time.time()
    phases = [{"name": "config", "start_s": 0.1, "seconds": 0.01, "detail": {}},
              {"name": "model_load", "start_s": 0.12, "seconds": 0.8, "detail": {"model": HOSTILE}}]
    write_report({"started_at": _iso(now - 1800), "started_unix": now - 1800, "pid": 11, "ready_s": 0.93,
                  "result": "crashed", "phase": "model_load", "signal": "SEGV", "model": HOSTILE,
                  "host": f"edge{RLO}1", "edge_version": "0", "phases": phases}, state, kind=FAILED_START)
    for i in range(3):
        t = now - 1200 + i * 360
        write_report({"started_at": _iso(t), "started_unix": t, "pid": 20 + i, "ready_s": 300.0, "result": "crashed",
                      "phase": "serving", "signal": "SEGV", "model": HOSTILE}, state, kind=CRASH)
    ladder = f"llama:{HOSTILE}"
    SafeMode(state, {ladder: Fallback(ladder, 1, "k", "warmup", "SEGV", _iso(now - 600))}).save()
    return now


def test_status_draws_crashes_and_safe_mode_and_shows_no_bidi_control(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    (tmp_path / "state").mkdir()
    _crash_story(tmp_path / "state")
    out = tmp_path / "crashes.svg"
    r = _edge("status", "--config", str(cfg), "--svg", str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert RLO not in r.stdout and "gemma<U+202E>fuggg.exe" in r.stdout  # the text output too
    text = out.read_text()
    assert RLO not in text and "gemma&lt;U+202E&gt;fuggg.exe" in text
    root = ET.fromstring(text)
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "start that CRASHED" in texts and "ready after" not in texts
    crashes = _groups(root, "data-crash")
    assert sorted((k, len(v)) for k, v in crashes.items()) == [("model_load", 1), ("serving", 3)]
    assert list(_groups(root, "data-safe-mode")) == ["gemma<U+202E>fuggg.exe"]
    assert "edge crashes and safe mode · 4 crash record(s)" in texts
    if chromium():
        _laid_out(out, tmp_path)
