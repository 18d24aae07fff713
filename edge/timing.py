"""Phase names, the phase timer and the start report: measured, written, read back (edge.cli.reports
prints them).

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

from edge.fsutil import atomic_write, private_dir

__all__ = ["BIDI_CONTROLS", "visible", "Phase", "PhaseObserver", "Phases", "StartTimer", "ReloadTimer", "write_report", "read_last_report",
           "rewrite_report", "last_report_name", "process_age_s", "REPORT_NAME", "RELOAD_REPORT_NAME", "UnreadableReport"]



def last_report_name(kind: str = "start") -> str:
    """The name of the last report of a kind (start, reload, failed-start, crash) in the state dir."""
    return f"last-{kind}.json"


REPORT_NAME = last_report_name("start")
RELOAD_REPORT_NAME = last_report_name("reload")


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
    reports = private_dir(state_dir / "reports")  # reports hold warm-up rows, workload prompts among them
    data = json.dumps(report, indent=2, sort_keys=False) + "\n"
    micros = int(time.time() * 1_000_000)  # failed reloads of one process come a few µs apart
    while True:  # a name of its own: an earlier report of this process is never replaced
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(micros // 1_000_000)) + f".{micros % 1_000_000:06d}"
        path = reports / f"{kind}-{stamp}-{report['pid']}.json"
        if not path.exists():
            break
        micros += 1
    atomic_write(path, data)
    atomic_write(state_dir / last_report_name(kind), data)
    _prune(reports, kind, keep=50)
    return path


def rewrite_report(report: dict[str, Any], path: Path, kind: str = "start") -> None:
    """`report` changed after write_report wrote it at `path` (a start's calibration after READY):
    written again there (atomically), and as the last report too unless a later process (a
    handover's new one) has written its own there since."""
    data = json.dumps(report, indent=2) + "\n"
    atomic_write(path, data)
    last = path.parent.parent / last_report_name(kind)  # path is <state dir>/reports/<name>
    try:
        ours = json.loads(last.read_text(encoding="utf-8")).get("pid") == report.get("pid")
    except (OSError, ValueError):
        ours = False
    if ours:
        atomic_write(last, data)


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
    path = state_dir / last_report_name(kind)
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
