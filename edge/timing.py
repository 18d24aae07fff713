"""Phase names, the phase timer and the start report: measured, written, read back and rendered.

Every phase of a start is measured against the moment the kernel started the process (from
/proc/self/stat), so the report also shows the cost of the interpreter and of imports that ran
before edge's own code. Phases may overlap (prefetch runs beside imports): each one carries its
own start offset and duration. `Phases` names every phase once; the start, the reload and
the engine load (edge.lifecycle.engines) all time theirs under those names.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge.fsutil import atomic_write

__all__ = ["BIDI_CONTROLS", "visible", "Phase", "PhaseObserver", "Phases", "StartTimer", "ReloadTimer", "format_report", "write_report", "read_last_report",
           "process_age_s", "REPORT_NAME", "RELOAD_REPORT_NAME", "format_reload_report", "UnreadableReport"]

REPORT_NAME = "last-start.json"
RELOAD_REPORT_NAME = "last-reload.json"


# Unicode's bidirectional controls (marks, embeddings, overrides, isolates): in a model, host or
# path name they reorder the text around them on screen (U+202E writes what follows backwards),
# so a report shown to a person (edge status, the SVG timeline) prints their code points instead
BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_SHOWN = {ord(c): f"<U+{ord(c):04X}>" for c in BIDI_CONTROLS}


def visible(text: str) -> str:
    """`text` with every bidirectional control written as its code point (<U+202E>): shown in
    the order it is stored."""
    return text.translate(_SHOWN)


def process_age_s() -> float:
    """Seconds since this process was started by the kernel (exec), from /proc/self/stat."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22 (starttime) counts after the ')' that ends the command name.
        start_ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / hz)
    except (OSError, ValueError, IndexError):
        return 0.0


class Phases:
    """Every phase name of the start report, in the order a start reaches them."""

    CONFIG = "config"
    SOCKETS = "sockets"
    RESOLVE_MODELS = "resolve_models"
    PAGE_IN = "page_in"
    VALIDATE = "validate"
    IMPORTS = "imports"
    MODEL_LOAD = "model_load"
    IMPORTS_HTTP = "imports_http"
    MLOCK_VERIFY = "mlock_verify"
    PREFIX_STATES = "prefix_states"  # declared/learned prefixes restored from disk (or computed)
    DEVICE = "device"  # engines (edge.lifecycle.engines): device, lookup, read, deserialize
    ENGINE_LOOKUP = "engine_lookup"
    ENGINE_READ = "engine_read"
    ENGINE_DESERIALIZE = "engine_deserialize"  # on the worker thread: the CUDA context made current there too
    WARMUP_SETUP = "warmup_setup"  # the candidates' targets and keys, the loopback HTTP server
    WARMUP = "warmup"
    HTTP_SETUP = "http_setup"
    READY = "ready"
    RECOVERY = "recovery"  # crash records settled, safe mode decided (edge.lifecycle.safemode)
    GIVEN_UP = "given_up"  # safe mode exhausted: only answering 503 (edge.lifecycle.unavailable)
    SERVING = "serving"  # not a phase of the report: where a process that dies after READY was
    # a reload (edge.lifecycle.reload) adds these to the load-and-warm phases above
    MEMORY_GUARD = "memory_guard"
    DRAIN_OLD = "drain_old"  # sequential: the old set drains and is freed before the load
    SWITCH = "switch"
    DRAIN = "drain"


@dataclass
class Phase:
    name: str
    start_s: float  # offset from process start
    seconds: float = 0.0
    bytes: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.bytes is not None and self.seconds > 0:
            d["mb_per_s"] = round(self.bytes / self.seconds / 1e6, 1)
        d["start_s"] = round(self.start_s, 4)
        d["seconds"] = round(self.seconds, 4)
        if self.bytes is None:
            del d["bytes"]
        return d


# Told when a phase begins (before it runs) and ends: ("enter" | "done", phase name, detail). The
# start journal (edge.fleet.journal) is one: it writes the phase down before the phase runs.
PhaseObserver = Callable[[str, str, dict[str, Any]], None]


class StartTimer:
    """Collects the phases of one start; offsets are from the exec of this process."""

    def __init__(self) -> None:
        self._mono0 = time.monotonic() - process_age_s()
        self.started_at = time.time() - (time.monotonic() - self._mono0)
        self.phases: list[Phase] = []
        self.observers: list[PhaseObserver] = []

    def now(self) -> float:
        return time.monotonic() - self._mono0

    @contextmanager
    def phase(self, name: str, **detail: Any) -> Iterator[Phase]:
        ph = Phase(name=name, start_s=self.now(), detail=dict(detail))
        for observe in self.observers:
            observe("enter", name, ph.detail)
        try:
            yield ph
        finally:
            ph.seconds = self.now() - ph.start_s
            self.phases.append(ph)
            for observe in self.observers:
                observe("done", name, ph.detail)

    def add(self, name: str, start_s: float, end_s: float, *, nbytes: int | None = None,
            **detail: Any) -> Phase:
        ph = Phase(name=name, start_s=start_s, seconds=end_s - start_s, bytes=nbytes, detail=detail)
        self.phases.append(ph)
        return ph

    def report(self, **extra: Any) -> dict[str, Any]:
        phases = sorted(self.phases, key=lambda p: p.start_s)
        return {
            "edge_version": _version(),
            "pid": os.getpid(),
            "host": os.uname().nodename,  # gethostname(), without importing socket before the config
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started_at)),
            "started_unix": round(self.started_at, 6),  # one start or reload, whatever else shares its second
            "ready_s": round(self.now(), 4),
            "phases": [p.as_dict() for p in phases],
            **extra,
        }


class ReloadTimer(StartTimer):
    """The phases of one reload: offsets from the moment the reload began, not from exec."""

    def __init__(self) -> None:
        super().__init__()
        self._mono0 = time.monotonic()
        self.started_at = time.time()


def _version() -> str:
    from edge import __version__

    return __version__


def write_report(report: dict[str, Any], state_dir: Path, kind: str = "start") -> Path:
    """Write the report as reports/<kind>-<time>-<pid>.json and, atomically, as last-<kind>.json
    (kind: start or reload)."""
    reports = state_dir / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report, indent=2, sort_keys=False) + "\n"
    micros = int(time.time() * 1_000_000)  # failed reloads of one process come a few µs apart
    while True:  # a name of its own: an earlier report of this process is never replaced
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(micros // 1_000_000)) + f".{micros % 1_000_000:06d}"
        path = reports / f"{kind}-{stamp}-{report['pid']}.json"
        if not path.exists():
            break
        micros += 1
    atomic_write(path, data)
    atomic_write(state_dir / f"last-{kind}.json", data)
    _prune(reports, kind, keep=50)
    return path


class UnreadableReport(ValueError):
    """A report file is there but is not one edge wrote: not JSON, not an object, a field missing."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        super().__init__(f"report {path} is unreadable: {why}")


# The fields every report carries (StartTimer.report), and what each one holds.
_FIELDS: dict[str, type | tuple[type, ...]] = {"edge_version": str, "pid": int, "host": str, "started_at": str,
                                               "ready_s": (int, float), "phases": list}


def read_last_report(state_dir: Path, kind: str = "start") -> dict[str, Any] | None:
    """last-<kind>.json; None when there is none yet; UnreadableReport when it is damaged."""
    path = state_dir / f"last-{kind}.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UnreadableReport(path, getattr(exc, "strerror", None) or str(exc)) from None
    except ValueError as exc:
        raise UnreadableReport(path, f"not valid JSON ({exc})") from None
    if not isinstance(report, dict):
        raise UnreadableReport(path, f"expected a JSON object, found {type(report).__name__}")
    for name, kinds in _FIELDS.items():
        if not isinstance(report.get(name), kinds) or isinstance(report.get(name), bool):
            raise UnreadableReport(path, f"field {name!r} missing or not a {_kind_name(kinds)}")
    bad = next((p for p in report["phases"] if not _is_phase(p)), None)
    if bad is not None:
        raise UnreadableReport(path, f"a phase is not an object of name, start_s, seconds, detail: {bad!r:.60}")
    return report


def _is_phase(p: Any) -> bool:
    return (isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("detail"), dict)
            and all(isinstance(p.get(k), (int, float)) for k in ("start_s", "seconds")))


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    return "number" if isinstance(kinds, tuple) else {"str": "string", "int": "integer"}.get(kinds.__name__,
                                                                                             kinds.__name__)


def _prune(folder: Path, kind: str, keep: int) -> None:
    old = sorted(folder.glob(f"{kind}-*.json"))[:-keep]
    for p in old:
        p.unlink(missing_ok=True)


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: one row per phase, then one per warm-up step."""
    lines = [f"last start: {report['started_at']}  pid {report['pid']}  host {report['host']}  "
             f"edge {report['edge_version']}",
             (f"rehearsal (nothing served): ready after {report['ready_s']:.3f} s"
              if report.get("rehearsal") else
              f"ready after {report['ready_s']:.3f} s on {', '.join(report.get('sockets', []))}"),
             *_compiled_lines(report), "",
             f"{'phase':<19}{'start s':>9}{'seconds':>9}{'MB':>9}{'MB/s':>9}  detail"]
    for p in report["phases"]:
        mb = f"{p['bytes'] / 1e6:.1f}" if "bytes" in p else ""
        rate = f"{p['mb_per_s']:.0f}" if "mb_per_s" in p else ""
        detail = ", ".join(f"{k}={v}" for k, v in p["detail"].items() if not isinstance(v, (list, dict)))
        lines.append(f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}{mb:>9}{rate:>9}  {detail}")
    lines += _model_lines(report)
    if report.get("warmup"):
        lines += ["", f"{'warm-up step':<19}{'seconds':>9}  what ran"]
        for w in report["warmup"]:
            lines.append(f"{w['name']:<19}{w['seconds']:>9.3f}  {w.get('model')}: {_warm_detail(w)}")
    for plan in report.get("calibration") or []:
        lines += _plan_lines(plan)
    return "\n".join(lines)


def _compiled_lines(report: dict[str, Any]) -> list[str]:
    """The source files this start compiled: none where the install left valid bytecode."""
    compiled = report.get("compiled") or []
    if not compiled:
        return []
    return [f"compiled {len(compiled)} source files at this start (no valid bytecode; `edge doctor` names "
            f"the fix): {', '.join(Path(c).name for c in compiled[:3])}{', ...' if len(compiled) > 3 else ''}"]


def _model_lines(report: dict[str, Any]) -> list[str]:
    """Each model's llama.cpp context settings, then each prefix state restored or computed."""
    lines = []
    for m in report.get("models") or []:
        c = m.get("context")
        if c:
            why = f" ({c['n_ctx_why']})" if c.get("n_ctx_why") else ""
            slots = f", {c['parallel']} slots ({c.get('parallel_why', 'parallel')})" if c.get("parallel") else ""
            lines.append(f"model {m['name']}: n_ctx {m.get('n_ctx')}{why}{slots}, n_batch {c['n_batch']}, n_ubatch "
                         f"{c['n_ubatch']}, threads {c['n_threads']} (batch {c['n_threads_batch']}), flash_attn "
                         f"{c['flash_attn']}, swa_full {str(c.get('swa_full')).lower()}, prompt cache up to "
                         f"{c['prompt_cache_limit_bytes'] / 2**20:.1f} MiB"
                         + ("" if c.get("use_extra_bufts", True) else ", extra buffer types off"))
    rows = [(p["detail"].get("model"), r) for p in report["phases"] if p["name"] == Phases.PREFIX_STATES
            for r in p["detail"].get("prefixes", [])]
    if rows:
        lines += ["", f"{'prefix state':<19}{'tokens':>9}{'MB':>9}{'seconds':>9}  outcome (why)"]
        lines += [f"{str(r['prefix']):<19}{r['tokens']:>9}{r['bytes'] / 1e6:>9.1f}{r['seconds']:>9.3f}  "
                  f"{model}: {r['kind']} {r['outcome']}" + (f" ({r['why']})" if r.get("why") else "")
                  for model, r in rows]
    return [""] + lines if lines else []


def _plan_lines(plan: dict[str, Any]) -> list[str]:
    """One warm-up plan: where it came from, then every candidate with first, repeat, kept."""
    name = plan.get("model") or plan.get("engine")
    head = {"calibrated": f"calibrated at this start ({plan.get('why')})",
            "stored": f"stored plan, calibrated {plan.get('calibrated_at')}",
            }.get(plan.get("plan", ""), f"{plan.get('plan')} ({plan.get('why')})")
    lines = ["", f"warm-up plan of {name}: {head}; file {plan.get('plan_file')}"]
    if plan.get("warning"):
        lines.append(f"  warning: {plan['warning']}")
    if plan.get("candidates"):  # waited: for a CPU (schedstat run_delay), over the first run and the repeat
        lines.append(f"{'candidate':<19}{'first s':>9}{'repeat s':>9}{'waited s':>15}  {'kept':<7} why")
    for c in plan.get("candidates", []):
        first, repeat = (f"{c[k]:.3f}" if c.get(k) is not None else "-" for k in ("first_s", "repeat_s"))
        waited = "/".join(f"{c[k]:.3f}" if c.get(k) is not None else "-" for k in ("delay_first_s", "delay_repeat_s"))
        kept = "pending" if c.get("pending") else "yes" if c.get("kept") else "no"
        lines.append(f"{c['name']:<19}{first:>9}{repeat:>9}{waited:>15}  {kept:<7} {c.get('why', '')}")
    lines += [f"not run: {x['name']}: {x['why']}" for x in plan.get("left_out", [])]
    return lines


def format_reload_report(report: dict[str, Any]) -> str:
    """A reload report: outcome, mode, what was kept and loaded, switch and drain, then phases."""
    head = f"last reload: {report['started_at']}  pid {report['pid']}  config {report.get('config')}"
    if report.get("reload_kind") == "process":
        return _format_handover(head, report)
    if report.get("error"):
        outcome = f"FAILED after {report['ready_s']:.3f} s: {report['error']} (the old set kept serving)"
    else:
        outcome = f"switched at {report.get('switch_s', 0):.3f} s; old set drained {_drained(report)}"
    mem = report.get("memory") or {}  # null: the reload failed before the memory guard decided
    mode = f"mode {report['mode']}: {mem.get('reason', '')}" if report.get("mode") else "mode: not decided"
    lines = [head, outcome, mode,
             f"kept: {', '.join(report.get('kept', [])) or '-'}   "
             f"loaded: {', '.join(report.get('loaded', [])) or '-'}   "
             f"freed: {', '.join(report.get('freed', [])) or '-'}", "",
             *_phase_rows(report["phases"])]
    return "\n".join(lines)


def _format_handover(head: str, report: dict[str, Any]) -> str:
    """A reload by a new process: why, the memory decision, both processes' phases."""
    new = report.get("successor") or {}
    if report.get("error"):
        outcome = f"HANDOVER FAILED after {report['ready_s']:.3f} s: {report['error']}"
    else:
        outcome = (f"handed over to pid {new.get('pid')} (edge {new.get('edge_version', '?')}) at "
                   f"{report.get('switch_s', 0):.3f} s; old process drained {_drained(report)}")
    lines = [head.replace("last reload", "last reload (new process)"), outcome,
             f"why: {'; '.join(report.get('why') or [])}",
             f"mode {report.get('mode')}: {(report.get('memory') or {}).get('reason', '')}", "",
             *_phase_rows(report["phases"])]
    if new.get("phases"):
        lines += ["", f"new process (pid {new.get('pid')}), offsets from its exec; ready at {new.get('ready_s')} s"]
        lines += [f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}" for p in new["phases"]]
    return "\n".join(lines)


def _phase_rows(phases: list[dict[str, Any]]) -> list[str]:
    """A reload report's phase table: its header, then a row per phase with its plain details."""
    rows = [f"{'phase':<19}{'start s':>9}{'seconds':>9}  detail"]
    for p in phases:
        detail = ", ".join(f"{k}={v}" for k, v in p["detail"].items() if not isinstance(v, (list, dict)))
        rows.append(f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}  {detail}")
    return rows


def _drained(report: dict[str, Any]) -> str:
    drain = report.get("drain_s")
    return f"in {drain:.3f} s" if drain is not None else "(still draining)"


def _warm_detail(w: dict[str, Any]) -> str:
    if "output_shapes" in w:
        return f"outputs {w['output_shapes']}"
    if "events" in w:
        return f"{w['events']} streamed events"
    return f"{w.get('prompt_tokens')} prompt tokens, {w.get('completion_tokens')} generated"
