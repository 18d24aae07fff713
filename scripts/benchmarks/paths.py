"""The four start paths (the seeds' cold-start practice) on Gemma 3 270M while 8 clients send
requests, each repeated (--repeats, at least 5) in rotating order, all in one run on one socket
(kit.PidOne holds it, as edge.socket does):

- cold: no edge process; the model file evicted from the page cache (posix_fadvise DONTNEED: no
  root needed, and only this file, not every other helper's cache), a fresh state dir (no warm-up
  plan, no prompt states); then a start;
- hot: no edge process, the weights cached, the state dir kept; then a start;
- restart: `systemctl restart`-like on a serving process: SIGTERM (drain), then a start on the
  held socket;
- upgrade: a handover to another installed edge version (`edge reload`, which sees the bumped
  `__version__` of the running copy of edge on disk and starts the new process itself).

For each: P50/P95/P99 of the ready time (start: spawn → READY=1; restart: SIGTERM → READY=1;
upgrade: `edge reload` run → the switch, MAINPID=) and of the first request's time to first token
(a streamed request sent as soon as the new process serves), the worst client request overlapping
the event against the steady P99 (measured first, same run), failed requests, and the peak memory
of the service's processes together (RSS and PSS, sampled every 50 ms; PSS counts a page mapped by
both processes once, RSS twice). JSON on stdout and in .bench/paths.json, a table on stderr.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


from benchmarks.load import TimedLoad, correct, in_windows
from benchmarks.common import EDGE, REQUEST, ROOT, edge_config, emit, env_for_bench, gemma_path, novel_prompts
from harness import PidOne

from edge.bytecode import compile_missing, package_sources
from edge.lifecycle.installed import installed_version
from edge.serve.bench import percentile

PATHS = ("cold", "hot", "restart", "upgrade")
BASE_VERSION = installed_version(ROOT / "edge") or "0"


def pcts(xs: list[float]) -> dict[str, Any]:
    return {"p50": round(percentile(xs, 0.50), 4), "p95": round(percentile(xs, 0.95), 4),
            "p99": round(percentile(xs, 0.99), 4), "n": len(xs)}


class Memory(threading.Thread):
    """The service's processes (the PID-1 stand-in's child and what it started) sampled every
    50 ms: the peak of their RSS and of their PSS summed."""

    def __init__(self, pid1: PidOne) -> None:
        super().__init__(daemon=True)
        self.pid1, self.stop_ = pid1, threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.max_procs = 0

    def run(self) -> None:
        while not self.stop_.wait(0.05):
            rss = pss = n = 0
            for pid in _group(self.pid1.pgid or 0):
                got = _rollup(pid)
                if got:
                    rss, pss, n = rss + got[0], pss + got[1], n + 1
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.max_procs = max(self.max_procs, n)

    def result(self) -> dict[str, Any]:
        self.stop_.set()
        self.join()
        return {"peak_rss_mib": round(self.peak_rss / 2**20, 1), "peak_pss_mib": round(self.peak_pss / 2**20, 1),
                "processes": self.max_procs}


def _group(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[2]) == pgid and stat[0] not in ("Z", "X"):
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _rollup(pid: int) -> tuple[int, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    rss = re.search(r"^Rss:\s+(\d+)", text, re.M)
    pss = re.search(r"^Pss:\s+(\d+)", text, re.M)
    return (int(rss.group(1)) * 1024, int(pss.group(1)) * 1024) if rss and pss else None


def ttft(address: tuple[str, int], prompt: str) -> float:
    """Seconds to the first streamed token of one request."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        while line := resp.readline():
            if line.startswith(b"data: {"):
                return time.monotonic() - t0
        raise RuntimeError("the stream ended without a token")
    finally:
        conn.close()


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Bench:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args, self.folder = args, folder
        self.model = gemma_path()
        self.site = folder / "site"  # the installed edge the service runs: a copy, its version bumped
        # this checkout's edge (not whatever `import edge` finds for this script)
        shutil.copytree(ROOT / "edge", self.site / "edge", ignore=shutil.ignore_patterns("__pycache__"))
        self.compile()
        # as on a device: the service never writes bytecode (ProtectSystem=strict), the install did
        self.env = {**env_for_bench(), "PYTHONPATH": str(self.site), "PYTHONSAFEPATH": "1",
                    "PYTHONDONTWRITEBYTECODE": "1"}
        self.cfg = edge_config(folder / "main", self.model, args.n_ctx)
        self.version = 0
        n = len(PATHS) * args.repeats + 1
        self.prompts = iter(novel_prompts(self.model, 24, list(range(100, 100 + n))))
        self.pid1 = PidOne([*EDGE, "serve", "--config", str(self.cfg)], env=self.env,
                           log_path=folder / "service.log")  # kept: every process's log, for a failed request

    def bump(self) -> str:
        self.version += 1
        version = f"{BASE_VERSION}.post{self.version}"
        init = self.site / "edge" / "__init__.py"
        init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{version}"', init.read_text()))
        self.compile()  # as a package update's install does
        return version

    def compile(self) -> None:
        failed = compile_missing(package_sources(self.site / "edge"))
        if failed:
            raise RuntimeError(f"cannot compile the installed copy: {failed[:3]}")

    def serving(self) -> bool:
        return self.pid1.proc is not None and self.pid1.proc.poll() is None

    def start(self, cfg: Path) -> float:
        """A start on the held socket; the monotonic time of READY=1."""
        self.pid1.argv = [*EDGE, "serve", "--config", str(cfg)]
        child = self.pid1.start()
        return self.pid1.wait_for("READY", "1", pid=child.pid, timeout=600).at

    def event(self, path: str, i: int) -> tuple[float, float, float, dict[str, Any]]:
        """One event of `path`: (its start, when the new process serves, when it is over, detail)."""
        detail: dict[str, Any] = {}
        if path in ("cold", "hot") and self.serving():
            self.pid1.stop()
        if path == "cold":
            cfg = edge_config(self.folder / f"cold-{i}", self.model, self.args.n_ctx)  # no plan, no states
            evict(self.model)
            t0 = time.monotonic()
            ready = self.start(cfg)
            return t0, ready, ready, detail
        if path == "hot":
            t0 = time.monotonic()
            ready = self.start(self.cfg)
            return t0, ready, ready, detail
        if path == "restart":
            t0 = time.monotonic()
            detail["old_exit"] = self.pid1.stop()
            ready = self.start(self.cfg)
            return t0, ready, ready, detail
        old = self.pid1.proc
        detail["version"] = self.bump()
        t0 = time.monotonic()
        r = subprocess.run([*EDGE, "reload", "--config", str(self.cfg), "--json"], capture_output=True,
                                         text=True, timeout=600, env=self.env)
        answer = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"ok": False, "error": r.stderr}
        if not answer.get("ok"):
            raise RuntimeError(f"upgrade failed: {answer.get('error')}")
        new = answer["report"]["successor"]["pid"]
        switched = self.pid1.wait_for("MAINPID", str(new), pid=old.pid).at
        old.wait(300)
        detail["why"] = answer["report"]["why"]
        return t0, switched, old.exited_at or time.monotonic(), detail

    def run_path(self, path: str, i: int, load: TimedLoad) -> dict[str, Any]:
        mem = Memory(self.pid1)
        mem.start()
        t0, ready, over, detail = self.event(path, i)
        first = ttft(self.pid1.address, next(self.prompts))
        load.wait_ok(load.result.ok + self.args.clients * 2, timeout=300)  # serving again before the next
        memory = mem.result()
        detail.update(_start_report(self.pid1.proc.pid if self.pid1.proc else 0, self.folder))
        lat = in_windows(load.spans, [(t0, over)])
        # where the slowest overlapping requests ran, from the event's start (the switch is ready_s)
        slow = sorted(((b - a, a - t0) for a, b in load.spans if a < over and b > t0), reverse=True)[:3]
        return {"path": path, "t0_monotonic": round(t0, 3), "loadavg_1m": round(os.getloadavg()[0], 2),
                "ready_s": round(ready - t0, 4), "first_ttft_s": round(first, 4),
                "worst_s": round(max(lat, default=0.0), 4), "requests_in_window": len(lat),
                "slowest_started_at_s": [[round(d, 3), round(at, 3)] for d, at in slow], **memory, **detail}


def _start_report(pid: int, folder: Path) -> dict[str, Any]:
    """The serving process's own start: its ready time after exec, and how much of the model was in
    the page cache when it began (resident_before: 0 for a cold node)."""
    for path in folder.glob("*/state/reports/start-*.json"):
        if path.name.endswith(f"-{pid}.json"):
            r = json.loads(path.read_text())
            page_in = next((p for p in r["phases"] if p["name"] == "page_in"), {"detail": {}})
            return {"process_ready_s": r["ready_s"], "resident_before": page_in["detail"].get("resident_before")}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady", type=float, default=30.0, help="seconds of steady load first")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"which of {','.join(PATHS)} (comma-separated)")
    args = ap.parse_args()
    args.paths = tuple(p for p in PATHS if p in args.paths.split(","))
    if not args.paths:
        ap.error(f"--paths: expected some of {','.join(PATHS)}")
    if args.repeats < 5:
        ap.error("--repeats: at least 5 (P95/P99 of fewer say nothing)")
    folder = Path(tempfile.mkdtemp(prefix="edge-paths-"))
    bench = Bench(args, folder)
    body = json.dumps(REQUEST).encode()
    result: dict[str, Any] = {"clients": args.clients, "repeats": args.repeats, "request": REQUEST,
                              "model": str(bench.model), "loadavg_before": os.getloadavg(), "events": []}
    with bench.pid1:
        bench.start(bench.cfg)
        load = TimedLoad(bench.pid1.address, body, clients=args.clients, max_seconds=24 * 3600, check=correct).start()
        load.wait_ok(args.clients * 2)
        t0 = time.monotonic()
        mem = Memory(bench.pid1)
        mem.start()
        time.sleep(args.steady)  # a fixed measuring window
        steady = [b - a for a, b in load.spans if a >= t0]
        result["steady"] = {"requests": len(steady), **pcts(steady), "max_s": round(max(steady), 4), **mem.result()}
        paths = args.paths
        for i in range(args.repeats):
            for path in paths[i % len(paths):] + paths[:i % len(paths)]:  # rotating order
                print(f"repeat {i + 1}/{args.repeats}: {path}", file=sys.stderr)
                result["events"].append({"repeat": i + 1, **bench.run_path(path, i, load)})
        r = load.stop()
        result["failed_total"] = r.errors + r.refused
        result["error_samples"] = r.error_samples[:5]

        bench.pid1.stop()
    result["loadavg_after"] = os.getloadavg()
    summarize(result)
    emit(result, "paths")
    table(result)
    return 0 if all(result["targets_met"].values()) else 1


def summarize(result: dict[str, Any]) -> None:
    steady_p99, one = result["steady"]["p99"], result["steady"]["peak_pss_mib"]
    paths = {}
    for path in PATHS:
        ev = [e for e in result["events"] if e["path"] == path]
        if not ev:
            continue
        paths[path] = {"ready_s": pcts([e["ready_s"] for e in ev]), "first_ttft_s": pcts([e["first_ttft_s"] for e in ev]),
                       "worst_s": max(e["worst_s"] for e in ev), "worst_vs_steady_p99": round(
                           max(e["worst_s"] for e in ev) / max(steady_p99, 1e-9), 2),
                       "peak_pss_mib": max(e["peak_pss_mib"] for e in ev),
                       "peak_rss_mib": max(e["peak_rss_mib"] for e in ev),
                       "peak_pss_vs_one_process": round(max(e["peak_pss_mib"] for e in ev) / max(one, 1e-9), 2)}
    result["paths"] = paths
    result["targets_met"] = {"0 failed requests": result["failed_total"] == 0}
    up = paths.get("upgrade")
    if up:
        one = result["steady"]["p50"]  # "+ at most one request's own time": a request queued behind one
        up["worst_vs_steady_p99_plus_one"] = round(up["worst_s"] / max(1.5 * steady_p99 + one, 1e-9) * 1.5, 2)
        result["targets_met"].update({"handover worst <= 1.5x steady p99": up["worst_vs_steady_p99"] <= 1.5,
                                      "handover worst <= 1.5x steady p99 + one request": up["worst_s"] <= 1.5 * steady_p99 + one,
                                      "handover peak PSS <= 1.6x one process": up["peak_pss_vs_one_process"] <= 1.6})


def table(result: dict[str, Any]) -> None:
    s = result["steady"]
    print(f"\nsteady: p50 {s['p50']:.3f}  p99 {s['p99']:.3f}  max {s['max_s']:.3f} s; one process PSS "
          f"{s['peak_pss_mib']:.0f} MiB (RSS {s['peak_rss_mib']:.0f}); load average before "
          f"{result['loadavg_before'][0]:.2f}, after {result['loadavg_after'][0]:.2f}", file=sys.stderr)
    print(f"{'path':<9}{'ready p50/p95/p99 s':>24}{'TTFT p50/p95/p99 s':>24}{'worst s':>9}{'x p99':>7}"
          f"{'PSS MiB':>9}{'x one':>7}{'RSS MiB':>9}", file=sys.stderr)
    for path, p in result["paths"].items():
        r, t = p["ready_s"], p["first_ttft_s"]
        print(f"{path:<9}{r['p50']:>8.2f}/{r['p95']:.2f}/{r['p99']:.2f}{'':>6}{t['p50']:>6.3f}/{t['p95']:.3f}/{t['p99']:.3f}"
              f"{p['worst_s']:>9.2f}{p['worst_vs_steady_p99']:>7.2f}{p['peak_pss_mib']:>9.0f}"
              f"{p['peak_pss_vs_one_process']:>7.2f}{p['peak_rss_mib']:>9.0f}", file=sys.stderr)
    print(f"failed requests: {result['failed_total']}; targets: {result['targets_met']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
