"""A start or reload report drawn as an SVG timeline (`edge status --svg`, `edge warmup --svg`).

One lane per thread of work, so what ran side by side and what waited shows at a glance: the
process's own steps, page-in (one lane per model: its threads run beside everything), GGUF
validation, backend imports, llama.cpp load and the mlock check, HTTP imports, engines, and the
warm-up with each of its requests. Bars are to scale (seconds on the axis) and say their seconds
and MB/s; READY (or a reload's switch, or its failure) is a line across every lane. A reload adds
the old set's lane: serving until the switch, then draining. A label that does not fit inside
its bar goes above it, in the first of two rows with room; where both are full (many short
warm-up steps), only the bar's hover title carries it.

Every text is laid out to fit: widths are counted in the monospace font's advance (0.6 em; a
wide character two), a line that would leave the canvas or run into the next text is elided
with "…", and its whole text is the <title> the browser shows on hover. The header has its own
rows (title, subtitle, the markers' labels, the axis), so no marker label covers a subtitle; a
failed start's error is wrapped under the lanes, at most ERROR_LINES lines.

Plain SVG written here (no plotting dependency), text escaped by xml.sax.saxutils; every bar
carries data-phase / data-step / data-marker attributes and a <title> with the phase's detail,
shown on hover.
"""

from __future__ import annotations

import math
import textwrap
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape as _escape
from xml.sax.saxutils import quoteattr as _quoteattr

from edge.timing import visible

__all__ = ["Bar", "Chart", "chart_of", "recovery_chart", "render_svg"]

WIDTH = 1100
PLOT_X = 180  # lane labels to the left of it (24 characters: "page-in · gemma3-270m")
PLOT_RIGHT = 24
LANE_H = 52
BAR_Y = 31  # a bar's top within its lane; above it, two rows of labels
LABEL_ROWS = (14, 27)
ADVANCE = 0.61  # a monospace glyph's advance per em: DejaVu Sans Mono 0.602, Menlo 0.602, Consolas 0.55
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
HEADER = (18, 34, 52, 68)  # baselines: title, subtitle, marker labels, axis; the lanes start at 76
LANES_TOP = 76
ERROR_LINES = 6
LINE_H = 15

# phase -> lane; a lane in PER_TARGET gets one lane per model or engine
LANES = {"config": "process", "sockets": "process", "resolve_models": "process",
         "memory_guard": "process", "warmup_setup": "warm-up", "http_setup": "process",
         "page_in": "page-in", "validate": "validation", "imports": "imports",
         "model_load": "load + mlock", "mlock_verify": "load + mlock", "imports_http": "HTTP imports",
         "device": "engines", "engine_lookup": "engines", "engine_read": "engines",
         "engine_deserialize": "engines", "warmup": "warm-up",
         "drain_old": "old set", "drain": "old set"}
LANE_ORDER = ("old set", "process", "page-in", "validation", "imports", "load + mlock", "HTTP imports",
              "engines", "warm-up", "crashes", "safe mode")
PER_TARGET = ("page-in",)
MARKERS = {"ready": "READY", "switch": "SWITCH"}
COLORS = {"process": "#7f7f7f", "page-in": "#4e79a7", "validation": "#59a14f", "imports": "#b07aa1",
          "load + mlock": "#f28e2b", "HTTP imports": "#9c755f", "engines": "#e15759",
          "warm-up": "#c9a227", "old set": "#76b7b2", "crashes": "#d62728", "safe mode": "#ff7f0e"}
MARKER_COLOR = {"READY": "#2ca02c", "SWITCH": "#2ca02c", "FAILED": "#d62728", "NOW": "#555"}


@dataclass
class Bar:
    lane: str
    start: float
    seconds: float
    label: str
    attrs: dict[str, str]
    tooltip: str = ""
    band: bool = False  # a background band (a warm-up phase behind its steps)

    def __post_init__(self) -> None:
        self.label = visible(self.label)  # measured as it is drawn


@dataclass
class Chart:
    title: str
    subtitle: str
    bars: list[Bar] = field(default_factory=list)
    markers: list[tuple[float, str, str]] = field(default_factory=list)  # (at, kind, text)
    error: str = ""  # a failed start's error: wrapped under the lanes

    @property
    def lanes(self) -> list[str]:
        seen = {b.lane for b in self.bars}
        base = [b.lane.split(" · ")[0] for b in self.bars]
        order = {lane: i for i, lane in enumerate(LANE_ORDER)}
        return sorted(seen, key=lambda lane: (order.get(lane.split(" · ")[0], len(order)),
                                              base.index(lane.split(" · ")[0]), lane))

    @property
    def end(self) -> float:
        ends = [b.start + b.seconds for b in self.bars] + [m[0] for m in self.markers]
        return max(ends + [0.001])


def _detail(p: dict[str, Any]) -> str:
    d = p.get("detail") or {}
    return ", ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, (list, dict)))


def _target(p: dict[str, Any]) -> str:
    d = p.get("detail") or {}
    return str(d.get("model") or d.get("engine") or "")


def _phase_label(p: dict[str, Any]) -> str:
    text = f"{p['name']} {float(p.get('seconds', 0)):.3f} s"
    if "mb_per_s" in p:
        text += f" · {float(p['mb_per_s']):.0f} MB/s"
    target = _target(p)
    return f"{text} ({target})" if target and p["name"] not in ("page_in",) else text


def _phase_bars(p: dict[str, Any]) -> Iterator[Bar]:
    lane = LANES.get(p["name"], "process")
    if lane in PER_TARGET and _target(p):
        lane = f"{lane} · {_target(p)}"
    start, seconds = float(p.get("start_s", 0)), float(p.get("seconds", 0))
    tip = f"{p['name']}: {start:.3f} s + {seconds:.3f} s\n{_detail(p)}"
    steps = (p.get("detail") or {}).get("steps") if p["name"] == "warmup" else None
    if not steps:
        yield Bar(lane, start, seconds, _phase_label(p), {"data-phase": p["name"]}, tip)
        return
    plan = (p.get("detail") or {}).get("plan")
    yield Bar(lane, start, seconds, f"{_phase_label(p)}{f', plan {plan}' if plan else ''}",
              {"data-phase": p["name"]}, tip, band=True)
    at = start  # the steps of one target run one after another, from the phase's start
    for s in steps:
        sec = float(s.get("seconds", 0))
        yield Bar(lane, at, sec, f"{s.get('name')} {sec:.3f} s",
                  {"data-step": str(s.get("name")), "data-target": _target(p)},
                  f"warm-up step {s.get('name')} of {_target(p)}: {sec:.3f} s, {s.get('path', '')}")
        at += sec


def chart_of(report: dict[str, Any], kind: str = "start") -> Chart:
    """The report's bars and markers; kind: start (or a rehearsal) or reload."""
    phases = [p for p in report.get("phases") or [] if isinstance(p, dict) and "name" in p]
    if kind == "reload":
        chart = Chart(f"edge reload · {report.get('started_at', '?')} · pid {report.get('pid', '?')}",
                      f"mode {report.get('mode') or 'not decided'} · kept {', '.join(report.get('kept') or []) or '-'}"
                      f" · loaded {', '.join(report.get('loaded') or []) or '-'} · config {report.get('config')}")
        chart.bars += _old_set(report, phases) + _new_process(report, phases)
    else:
        end = _end_of(report)
        what = ("rehearsal (edge warmup, nothing served)" if report.get("rehearsal") else
                f"start that {end[0]}" if end else "start")
        chart = Chart(f"edge {what} · {report.get('host', '?')} · {report.get('started_at', '?')} · "
                      f"pid {report.get('pid', '?')} · edge {report.get('edge_version', '?')}",
                      f"{end[1] if end else 'ready after'} {float(report.get('ready_s', 0)):.3f} s (offsets "
                      f"from exec) · sockets {', '.join(report.get('sockets') or []) or '-'}")
    for p in phases:
        if p["name"] in MARKERS:
            at = float(p.get("start_s", 0))
            chart.markers.append((at, MARKERS[p["name"]], f"{MARKERS[p['name']]} {at:.2f} s"))
        else:
            chart.bars += list(_phase_bars(p))
    end = _end_of(report) if kind != "reload" else (("FAILED", "", "FAILED") if report.get("error") else None)
    if end:  # a start that did not reach READY (or a failed reload): where it ended, never READY
        at = float(report.get("ready_s", chart.end))
        chart.markers.append((at, end[2], f"{end[2]} {at:.2f} s"))
        chart.error = f"error: {report['error']}" if report.get("error") else ""
    elif report.get("rehearsal"):  # nothing was served: where READY=1 would have come
        at = float(report.get("ready_s", chart.end))
        chart.markers.append((at, "READY", f"would be READY {at:.2f} s"))
    return chart


def _end_of(report: dict[str, Any]) -> tuple[str, str, str] | None:
    """How a start that did not reach READY ended: (title word, subtitle's outcome, marker); None
    for a start that did (or a rehearsal). Every result but ok, and an error without a result."""
    result = report.get("result")
    if result in (None, "ok") and not report.get("error") or report.get("rehearsal"):
        return None
    if result == "crashed":
        return "CRASHED", f"killed by signal {report.get('signal') or 'unknown'} after", "CRASHED"
    if result == "timeout":
        return "TIMED OUT", "stopped by systemd's TimeoutStartSec= after", "TIMEOUT"
    if result == "stopped":
        return "was STOPPED", "stopped (SIGTERM) before it was ready, after", "STOPPED"
    return "FAILED", f"exit {report.get('exit_code')} after", "FAILED"


def recovery_chart(crashes: list[dict[str, Any]], safe: list[dict[str, Any]], now: float) -> Chart | None:
    """Crash records (edge.fleet.crashes.recent_crashes) and safe mode's steps in force on one
    axis, from the first of them to `now` (unix seconds); None when there are neither."""
    from edge.fleet.history import timestamp

    if not crashes and not safe:
        return None
    when = {id(c): float(t) if isinstance(t := c.get("ended_unix") or c.get("started_unix"), (int, float)) else now
            for c in crashes}  # when each crash happened (records before ended_unix: their start)
    since = [(s, timestamp(s.get("since")) or now) for s in safe]
    t0 = min([*when.values(), *(t for _, t in since)])
    first = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))
    chart = Chart(f"edge crashes and safe mode · {len(crashes)} crash record(s), the first at "
                  f"{crashes[0].get('at') if crashes else '-'}", f"offsets from {first} · safe mode: {len(safe)} step(s)")
    for c in crashes:
        on = f", {c.get('model') or c.get('engine')}" if c.get("model") or c.get("engine") else ""
        chart.bars.append(Bar("crashes", when[id(c)] - t0, 0.0, f"{c.get('signal') or '?'} {c.get('phase') or '?'}",
                              {"data-crash": str(c.get("phase") or "unknown")}, f"{c.get('result')} at {c.get('at')}, "
                              f"pid {c.get('pid')}: phase {c.get('phase')}, signal {c.get('signal')}{on}"))
    for s, t in since:
        chart.bars.append(Bar("safe mode", t - t0, now - t, f"{s.get('target')}: {s.get('fallback')}",
                              {"data-safe-mode": str(s.get("target"))},
                              f"safe mode since {s.get('since')}: {s.get('target')}: {s.get('fallback')} ({s.get('reason')})"))
    chart.markers.append((max(now - t0, chart.end), "NOW", "now"))
    return chart


def _old_set(report: dict[str, Any], phases: list[dict[str, Any]]) -> list[Bar]:
    """The set that served while the reload ran: serving until the switch (or, sequential, until
    its drain before the load; a failed reload: throughout), then draining (the drain phases)."""
    held = next((float(p["start_s"]) for p in phases if p["name"] == "drain_old"), None)
    switch = report.get("switch_s")
    end = held if held is not None else float(switch) if switch is not None else float(report.get("ready_s", 0))
    return [Bar("old set", 0.0, end, "old set serving", {"data-phase": "serving"},
                f"the old set serves every request until {end:.3f} s")]


def _new_process(report: dict[str, Any], phases: list[dict[str, Any]]) -> list[Bar]:
    """A handover's new process: its start's phases, from its spawn on the reload's axis."""
    new = report.get("successor")
    spawn = next((float(p["start_s"]) for p in phases if p["name"] == "spawn"), None)
    if not isinstance(new, dict) or spawn is None:
        return []
    lane = f"new process {new.get('pid', '?')}"
    return [Bar(lane, spawn + float(p.get("start_s", 0)), float(p.get("seconds", 0)), _phase_label(p),
                {"data-phase": str(p["name"]), "data-process": "new"}, f"new process: {p['name']}")
            for p in new.get("phases") or [] if isinstance(p, dict) and "name" in p]


# -- SVG --------------------------------------------------------------------------------------------
def escape(text: str) -> str:
    """Text for the SVG: XML-escaped, its bidirectional controls shown as code points (a name with
    U+202E must not reorder the line it is drawn in)."""
    return _escape(visible(text))


def quoteattr(text: str) -> str:
    return _quoteattr(visible(text))


def _ticks(end: float) -> list[float]:
    """Axis ticks at 1, 2 or 5 x 10^k seconds, about eight of them."""
    raw = end / 8
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [round(i * step, 6) for i in range(int(end / step + 1e-9) + 1)]


def _width(text: str, size: float) -> float:
    """The text's width in a monospace font: a wide (East Asian) character takes two cells."""
    cells = sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
                for ch in text)
    return cells * size * ADVANCE


def _elided(text: str, room: float, size: float) -> str:
    """The text, cut to `room` pixels with "…" where it is longer."""
    if _width(text, size) <= room:
        return text
    while text and _width(text + "…", size) > room:
        text = text[:-1]
    return text + "…"


def _text(x: float, y: float, text: str, *, size: int = 11, fill: str = "#222", anchor: str = "start",
          weight: str = "normal", halo: bool = False, room: float | None = None) -> str:
    """One line; with `room`, elided to that many pixels, the whole text in its <title>."""
    text = visible(text)  # measured as drawn
    shown = text if room is None else _elided(text, room, size)
    # a halo (white stroke painted under the glyphs) keeps text legible over grid and marker lines
    ring = ' stroke="#fff" stroke-width="3" paint-order="stroke"' if halo else ""
    line = (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" text-anchor="{anchor}" '
            f'font-weight="{weight}"{ring}>{escape(shown)}</text>')
    return line if shown == text else f"<g><title>{escape(text)}</title>{line}</g>"


class _Canvas:
    """Draws one chart from `top`, seconds mapped onto the plot's width."""

    def __init__(self, chart: Chart, top: float) -> None:
        self.chart, self.top = chart, top
        self.scale = (WIDTH - PLOT_X - PLOT_RIGHT) / (chart.end * 1.02)
        self.lanes = chart.lanes
        self.lanes_top = top + LANES_TOP
        lines = textwrap.wrap(visible(chart.error), int((WIDTH - 16) / (11 * ADVANCE)), break_on_hyphens=False)
        lines = lines[:ERROR_LINES - 1] + [" ".join(lines[ERROR_LINES - 1:])] if len(lines) > ERROR_LINES else lines
        self.error = [_elided(line, WIDTH - 16, 11) for line in lines]  # wide characters: still inside
        self.height = LANES_TOP + LANE_H * len(self.lanes) + 18 + LINE_H * len(self.error)

    def x(self, t: float) -> float:
        return PLOT_X + t * self.scale

    def draw(self) -> list[str]:
        c = self.chart
        out = [_text(8, self.top + HEADER[0], c.title, size=13, weight="bold", room=WIDTH - 16),
               _text(8, self.top + HEADER[1], c.subtitle, fill="#555", room=WIDTH - 16)]
        bottom = self.lanes_top + LANE_H * len(self.lanes)
        for t in _ticks(c.end):
            out.append(f'<line x1="{self.x(t):.1f}" y1="{self.lanes_top - 6:.1f}" x2="{self.x(t):.1f}" '
                       f'y2="{bottom:.1f}" stroke="#e3e3e3"/>')
            out.append(_text(self.x(t), self.top + HEADER[3], f"{t:g} s", size=10, fill="#777", anchor="middle"))
        for i, lane in enumerate(self.lanes):
            y = self.lanes_top + i * LANE_H
            if i % 2:
                out.append(f'<rect x="0" y="{y:.1f}" width="{WIDTH}" height="{LANE_H}" fill="#f6f6f6"/>')
            out.append(_text(8, y + LANE_H / 2 + 8, lane, weight="bold", room=PLOT_X - 14,
                             fill=COLORS.get(lane.split(" · ")[0], "#333")))
        for at, kind, _ in c.markers:  # the line behind the bars, its label in the header's marker row
            out.append(f'<line data-marker={quoteattr(kind.lower())} x1="{self.x(at):.1f}" '
                       f'y1="{self.top + HEADER[2] + 4:.1f}" x2="{self.x(at):.1f}" y2="{bottom:.1f}" '
                       f'stroke="{MARKER_COLOR.get(kind, "#d62728")}" stroke-width="2"/>')
        free: dict[tuple[str, int], float] = {}  # (lane, row) -> x where that label row is free again
        for bar in sorted(c.bars, key=lambda b: (not b.band, b.start)):
            out += self._bar(bar, self.lanes_top + self.lanes.index(bar.lane) * LANE_H, free)
        out += self._markers()
        if self.error:  # the whole error on hover, its lines (wrapped, the last elided) under the lanes
            out += [f'<g data-error="failed"><title>{escape(c.error)}</title>',
                    *(_text(8, bottom + 18 + i * LINE_H, line, fill=MARKER_COLOR["FAILED"])
                      for i, line in enumerate(self.error)), "</g>"]
        return out

    def _bar(self, bar: Bar, y: float, free: dict[tuple[str, int], float]) -> list[str]:
        x0, w = self.x(bar.start), max(bar.seconds * self.scale, 2.0)
        color = COLORS.get(bar.lane.split(" · ")[0], "#999")
        attrs = " ".join(f"{k}={quoteattr(v)}" for k, v in bar.attrs.items())
        out = [f'<g {attrs}><title>{escape(bar.tooltip or bar.label)}</title>']
        if bar.band:
            out.append(f'<rect x="{x0:.1f}" y="{y + 3:.1f}" width="{w:.1f}" height="{LANE_H - 6}" '
                       f'fill="{color}" opacity="0.18" rx="3"/>')
        else:
            out.append(f'<rect x="{x0:.1f}" y="{y + BAR_Y:.1f}" width="{w:.1f}" height="16" fill="{color}" '
                       'rx="2" stroke="#fff" stroke-width="0.6"/>')
        if not bar.band and _width(bar.label, 11) + 8 <= w:  # inside the bar
            out.append(_text(x0 + 4, y + BAR_Y + 12, bar.label, fill="#fff"))
        elif bar.label:
            out += self._label_above(bar, x0, w, y, free)
        out.append("</g>")
        return out

    def _label_above(self, bar: Bar, x0: float, w: float, y: float, free: dict[tuple[str, int], float]) -> list[str]:
        """In the first of the lane's label rows with room, pushed right past that row's previous
        label; a leader line back to the bar when pushed. The plot's width at most (elided)."""
        label = _elided(bar.label, WIDTH - PLOT_RIGHT - PLOT_X, 11)
        text_w = _width(label, 11)
        for row, baseline in enumerate(LABEL_ROWS):
            taken = max(free.get((bar.lane, row), 0.0), PLOT_X)
            lx = min(max(x0, taken), WIDTH - PLOT_RIGHT - text_w)
            if lx >= taken:
                break
        else:
            return []  # both rows full (many short warm-up steps): the bar's <title> says it on hover
        out = [_text(lx, y + baseline, label, fill="#333", halo=True)]
        if lx > x0 + 3 and not bar.band:
            out.append(f'<line x1="{x0 + w / 2:.1f}" y1="{y + BAR_Y:.1f}" x2="{lx:.1f}" y2="{y + baseline + 2:.1f}" '
                       'stroke="#aaa" stroke-width="0.8"/>')
        free[(bar.lane, row)] = lx + text_w + 10
        return out

    def _markers(self) -> list[str]:
        """Each marker's label in the header's marker row: right of its line, or left of it near
        the right edge, never over the previous label (dropped, hover title only, if it cannot fit)."""
        out, free = [], 8.0
        for at, kind, text in sorted(self.chart.markers):
            x, w = self.x(at), _width(text, 12)
            tx = x + 4 if x + 4 + w <= WIDTH - 4 else x - 4 - w
            tx = max(tx, free)
            if tx + w > WIDTH - 4:
                continue
            out += [f'<g data-marker={quoteattr(kind.lower())}><title>{escape(text)}</title>',
                    _text(tx, self.top + HEADER[2], text, size=12, fill=MARKER_COLOR.get(kind, "#d62728"),
                          weight="bold", halo=True), "</g>"]
            free = tx + w + 12
        return out


def render_svg(charts: list[Chart]) -> str:
    """One SVG document with the charts stacked (a start, then its reload)."""
    body, top = [], 0.0
    for chart in charts:
        canvas = _Canvas(chart, top)
        body += canvas.draw()
        top += canvas.height + 10
    return "\n".join([
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{top:.0f}" '
        f'viewBox="0 0 {WIDTH} {top:.0f}" font-family="{FONT}">',
        f'<rect width="{WIDTH}" height="{top:.0f}" fill="#fff"/>', *body, "</svg>", ""])
