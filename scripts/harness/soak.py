"""A soak of reloads that keep the model: clients send requests without a pause while `edge reload`
switches between two configs that differ only in a server setting (so the loaded model and its
worker are kept), and what the service wrote is searched for llama.cpp's decode errors. Used by
tests/lifecycle/test_reload_soak.py (short, the tiny model) and `scripts/bench soak_reload` (10
minutes, Gemma 3 270M)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import EDGE
from harness.load import ClientLoad

__all__ = ["DECODE_ERROR", "SoakResult", "reload_soak"]

DECODE_ERROR = re.compile(r"llama_decode|invalid batch|failed to find a memory slot")


@dataclass
class SoakResult:
    ok: int = 0
    failed: int = 0  # answers that were not a 200 with a whole body, and refused connections
    reloads: list[dict[str, Any]] = field(default_factory=list)  # each: rc, kept, seconds
    decode_errors: list[str] = field(default_factory=list)  # the service log's lines about them
    samples: list[str] = field(default_factory=list)
    p50_s: float = 0.0
    p95_s: float = 0.0
    longest_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": self.failed, "reloads": len(self.reloads),
                "reloads_failed": sum(1 for r in self.reloads if r["rc"] != 0),
                "reloads_that_reloaded_the_model": sum(1 for r in self.reloads if not r["kept"]),
                "decode_errors": len(self.decode_errors), "decode_error_lines": self.decode_errors[:5],
                "failure_samples": self.samples[:5], "p50_s": round(self.p50_s, 3),
                "p95_s": round(self.p95_s, 3), "longest_s": round(self.longest_s, 3)}


def _answered(status: int, body: bytes) -> bool:
    if status != 200:
        return False
    try:
        return bool(json.loads(body)["choices"])
    except (ValueError, KeyError, TypeError):
        return False


def reload_soak(address: tuple[str, int], configs: tuple[Path, Path], log: Path, request: dict[str, Any],
                *, clients: int = 8, pace: Callable[[ClientLoad, int], bool]) -> SoakResult:
    """`clients` threads send `request` until `pace(load, i)` (called before the i-th reload: it
    waits for whatever paces the soak, answers or time) says to stop; after each wait the service
    is reloaded with the other config. The reports' `kept` says whether the model was kept."""
    load = ClientLoad(address, json.dumps(request).encode(), clients=clients, max_seconds=24 * 3600,
                      timeout=600, check=_answered).start()
    out = SoakResult()
    try:
        i = 0
        while pace(load, i):
            cfg = configs[(i + 1) % 2]
            t0 = time.monotonic()
            done = subprocess.run([*EDGE, "reload", "--config", str(cfg)], capture_output=True, text=True,
                                  timeout=600)
            report = json.loads((cfg.parent / "state" / "last-reload.json").read_text())
            out.reloads.append({"rc": done.returncode, "kept": bool(report.get("kept")), "error": report.get("error"),
                                "seconds": round(time.monotonic() - t0, 3), "stderr": done.stderr[-300:]})
            i += 1
    finally:
        result = load.stop()
    out.ok, out.failed, out.samples = result.ok, result.errors + result.refused, result.error_samples
    if result.latencies:
        out.p50_s, out.p95_s, out.longest_s = result.percentile(0.5), result.percentile(0.95), result.longest_s
    text = log.read_text(errors="replace") if log.exists() else ""
    out.decode_errors = [line for line in text.splitlines() if DECODE_ERROR.search(line)]
    return out


def every(seconds: float, rounds: int) -> Callable[[ClientLoad, int], bool]:
    """Pace a soak by the clock: a reload every `seconds`, `rounds` of them (a soak's rhythm is
    time by definition; the wait is an event's, woken only by its timeout)."""
    tick = threading.Event()

    def pace(load: ClientLoad, i: int) -> bool:
        if i >= rounds:
            return False
        tick.wait(seconds)
        return True
    return pace


def answers(per_reload: int, rounds: int) -> Callable[[ClientLoad, int], bool]:
    """Pace a soak by the answers: a reload after every `per_reload` more, `rounds` of them."""
    def pace(load: ClientLoad, i: int) -> bool:
        if i >= rounds:
            return False
        load.wait_ok(per_reload * (i + 1), timeout=300)
        return True
    return pace
