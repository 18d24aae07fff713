"""A real browser for the SVG timeline: headless Chromium (Debian's `chromium`, which
scripts/setup installs) lays the SVG out, says where each text box is (`getBBox()`, in the
SVG's own units, from the browser's own layout and fonts), and renders it to PNG: what a person
sees, checked the way a person would look at it."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import pytest

__all__ = ["Box", "chromium", "layout", "overlaps", "png_size", "render_png"]

# the page: the SVG inline, then a script that writes every <text>'s box into the DOM, which
# --dump-dom prints once the page has loaded (system fonts are there before the script runs)
_PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><style>body{{margin:0}}</style></head><body>
{svg}
<pre id="boxes"></pre>
<script>
const svg = document.querySelector("svg");
const out = {{width: svg.width.baseVal.value, height: svg.height.baseVal.value, texts: []}};
for (const t of svg.querySelectorAll("text")) {{
  const b = t.getBBox();
  out.texts.push({{x: b.x, y: b.y, w: b.width, h: b.height, text: t.textContent}});
}}
document.getElementById("boxes").textContent = JSON.stringify(out);
</script></body></html>"""


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float
    text: str

    def inside(self, width: float, height: float) -> bool:
        return self.x >= 0 and self.y >= 0 and self.x + self.w <= width and self.y + self.h <= height


def chromium() -> str:
    """The browser's path, or a skip that says why and where it comes from."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        reason = ("no headless Chromium here (Debian's `chromium`, which scripts/setup installs: "
                  "scripts/setup.d/chromium.sh): the SVG was checked as XML only")
        print(reason)
        pytest.skip(reason)
    return found


def _run(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-1000:]
    return r


def layout(svg: Path, work: Path) -> tuple[float, float, list[Box]]:
    """(width, height, every text's box) as Chromium lays the SVG out."""
    browser = chromium()
    text = re.sub(r"^<\?xml[^>]*\?>\s*", "", svg.read_text())
    page = work / f"{svg.stem}.layout.html"
    page.write_text(_PAGE.format(svg=text))
    dom = _run(browser, work / "profile", "--dump-dom", page.resolve().as_uri()).stdout
    found = re.search(r'<pre id="boxes">(.*?)</pre>', dom, re.S)
    assert found and found.group(1), dom[-2000:]
    data = json.loads(found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    return data["width"], data["height"], [Box(**t) for t in data["texts"]]


def overlaps(boxes: list[Box], slack: float = 0.5) -> list[tuple[Box, Box]]:
    """Pairs of text boxes that cover each other (by more than `slack` SVG units each way)."""
    def meet(a: Box, b: Box) -> bool:
        return (min(a.x + a.w, b.x + b.w) - max(a.x, b.x) > slack
                and min(a.y + a.h, b.y + b.h) - max(a.y, b.y) > slack)

    return [(a, b) for a, b in combinations(boxes, 2) if meet(a, b)]


def render_png(svg: Path, out: Path, width: int, height: int) -> Path:
    _run(chromium(), out.parent / "profile", f"--window-size={width},{height}", f"--screenshot={out}", svg.resolve().as_uri())
    return out


def png_size(png: Path) -> tuple[int, int]:
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])
