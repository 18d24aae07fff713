"""Crash records: a journal (edge.fleet.journal) whose process is gone becomes a report, counted
once by the history ledger and shown by `edge status`.

A start that died before READY becomes `reports/failed-start-*.json` with `result` "crashed"
(killed by a signal) or "timeout" (systemd gave up on it: TimeoutStartSec=); a process that died
after READY becomes `reports/crash-*.json` (phase "serving", or the reload phase it was in). Each
carries the phase, the model or engine it was working on, the signal (from systemd's
ExecStopPost= when it ran, else "unknown"), and the safe-mode keys the journal wrote, so that
edge.lifecycle.safemode can tell the same crash twice from two different ones. A start that
ended by itself wrote its own report; systemd's word can still change it: a start stopped by
SIGTERM that systemd sent for TimeoutStartSec= is a "timeout", not a "stopped".

Each record names its `cause` (`cause_of`), what the end is evidence of; only a native fault is
evidence against llama.cpp's native paths (edge.lifecycle.safemode counts `NATIVE_CAUSES`):

    native-fault   SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGFPE (not systemd's watchdog abort)
    fatal-error    the process found itself unfit to go on (a lost CUDA context), signal "none"
    unknown        no exit record: a power loss, a kernel panic, a hardware watchdog mid-start
    oom            the kernel's OOM killer: systemd's oom-kill, or the cgroup's oom_kill count
                   (memory.events) grew between the start and ExecStopPost=
    watchdog       systemd's WatchdogSec= (it aborts with SIGABRT: still not a native fault)
    timeout        systemd's TimeoutStartSec=/TimeoutStopSec=
    outside-kill   any other signal that ended it: SIGKILL from a person or a script, SIGTERM
                   before edge's handler, SIGQUIT, ...
    exit           it exited with a status without a word of its own (os._exit, a native exit())
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from edge.fleet.history import CRASH, FAILED_START, Ledger, read_json
from edge.fleet.journal import JournalRead, Stop, journals
from edge.fsutil import atomic_write
from edge.timing import write_report

__all__ = ["CAUSES", "NATIVE_CAUSES", "NATIVE_SIGNALS", "cause_of", "crash_report", "ended_unix", "recent_crashes",
           "settle", "settle_all"]

log = logging.getLogger("edge")

CRASHED, TIMEOUT = "crashed", "timeout"
NATIVE_SIGNALS = frozenset({"SEGV", "BUS", "ILL", "ABRT", "FPE"})
CAUSES = ("native-fault", "fatal-error", "unknown", "oom", "watchdog", "timeout", "outside-kill", "exit")
NATIVE_CAUSES = frozenset({"native-fault", "fatal-error", "unknown"})  # what safe mode counts
_SYSTEMD_CAUSES = {"watchdog": "watchdog", "oom-kill": "oom", TIMEOUT: "timeout"}  # $SERVICE_RESULT


def cause_of(signal: str | None, service_result: str = "", exit_status: Any = "", oom_grew: bool = False) -> str:
    """What one end is evidence of (the table above): systemd's word first (it knows a watchdog
    abort and a timeout kill), then the cgroup's OOM count, then the signal."""
    if service_result in _SYSTEMD_CAUSES:
        return _SYSTEMD_CAUSES[service_result]
    if oom_grew and signal == "KILL":
        return "oom"
    if signal in (None, "", "unknown"):
        return "exit" if str(exit_status or "").isdigit() else "unknown"
    if signal == "none":
        return "fatal-error"
    return "native-fault" if signal in NATIVE_SIGNALS else "outside-kill"


def settle_all(state_dir: Path, stop: Stop | None = None) -> list[Path]:
    """Turn every journal whose process is gone into its record; `stop` (ExecStopPost's view)
    belongs to the newest of them that has none yet: the main process that just ended."""
    dead = [j for j in journals(state_dir) if not j.alive()]
    if stop is not None:
        fresh = [j for j in dead if j.stop is None]
        if fresh:
            max(fresh, key=lambda j: float(j.head.get("started_unix") or 0)).stop = stop
    written = [p for j in dead if (p := settle(state_dir, j)) is not None]
    if dead:
        Ledger(state_dir).update()  # counted now: reports are pruned, and a crash loop is never scraped
    return written


def settle(state_dir: Path, j: JournalRead) -> Path | None:
    """The record of one ended process; its journal removed. Returns the report written, if one was."""
    path = None
    try:
        if j.end is None:
            kind = CRASH if j.ready is not None else FAILED_START
            path = write_report(crash_report(j), state_dir, kind=kind)
        elif j.stop is not None and j.stop.result == TIMEOUT and j.end.get("end") == "stopped":
            _amend(state_dir, j.end.get("report"), result=TIMEOUT, service_result=j.stop.result)
        j.path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot record how pid %s ended from %s: %s", j.pid, j.path, exc)
    return path


def crash_report(j: JournalRead) -> dict[str, Any]:
    """A report in the shape of a start report (edge.timing), from what the journal says."""
    where = j.phase()
    stop = j.stop
    signal = stop.signal if stop is not None else None
    result = TIMEOUT if stop is not None and stop.result == TIMEOUT else CRASHED
    target = {k: where[k] for k in ("model", "engine") if k in where}
    on = ", ".join(f"{k} {v}" for k, v in target.items())
    how = (f"killed by SIG{signal}" if signal else f"ended with exit status {stop.status}" if stop and stop.status
           else "ended without a word (no exit record: a power loss, or no ExecStopPost=)")
    if stop is not None and stop.result in ("oom-kill", "watchdog", TIMEOUT):
        how += f" (systemd: {stop.result})"
    phase = where["enter"]
    start_ooms, end_ooms = j.head.get("oom_kills"), stop.oom_kills if stop is not None else None
    oom_grew = isinstance(start_ooms, int) and isinstance(end_ooms, int) and end_ooms > start_ooms
    cause = cause_of(signal, stop.result if stop else "", stop.status if stop and not signal else "", oom_grew)
    if cause == "oom" and (stop is None or stop.result != "oom-kill"):
        how += " (the cgroup's OOM killer)"
    return {"edge_version": str(j.head.get("edge_version", "")), "pid": j.pid, "host": _host(),
            "started_at": str(j.head.get("started_at", "")), "started_unix": j.head.get("started_unix"),
            "ended_unix": ended_unix(j), "ready_s": j.last_t, "phases": _phases(j), "result": result, "phase": phase, **target,
            "signal": signal or "unknown", "exit_status": stop.status if stop else "",
            "service_result": stop.result if stop else "", "cause": cause, "keys": j.keys, "reached_ready": j.ready is not None,
            "error": f"{how} in phase {phase}" + (f" ({on})" if on else "")}


def ended_unix(j: JournalRead) -> float:
    """When the process ended: systemd's word (ExecStopPost= runs as the main process is gone),
    else its own last word (a journal `end`), else now, when this record is made (a power loss:
    the next start settles it). Never the READY before it: a service that crashes every 20
    minutes has 3 crashes in an hour, dated 20 minutes apart, whatever each start took."""
    if j.stop is not None and j.stop.at is not None:
        return round(j.stop.at, 3)
    start, end_t = j.head.get("started_unix"), (j.end or {}).get("t")
    if isinstance(start, (int, float)) and isinstance(end_t, (int, float)):
        return round(float(start) + float(end_t), 3)
    return round(time.time(), 3)


def _phases(j: JournalRead) -> list[dict[str, Any]]:
    """The phases it entered, each until the next one began (the last: until its last word)."""
    out = []
    times = [float(e["t"]) for e in j.entered] + [j.last_t]
    for e, t, t_next in zip(j.entered, times, times[1:]):
        detail = {k: v for k, v in e.items() if k not in ("enter", "t") and (k != "after_ready" or v)}
        if e["enter"] not in j.finished:
            detail["unfinished"] = True
        out.append({"name": e["enter"], "start_s": t, "seconds": round(max(0.0, t_next - t), 4), "detail": detail})
    return out


def _amend(state_dir: Path, name: Any, **fields: Any) -> None:
    """systemd's word added to a report, and to its copy as last-failed-start.json where that copy
    is still this report (what `edge status` and its SVG draw)."""
    if not isinstance(name, str) or "/" in name:
        return
    path = state_dir / "reports" / name
    report = read_json(path)
    if report is None:
        return
    import json

    data = json.dumps({**report, **fields}, indent=2) + "\n"
    atomic_write(path, data)
    last = state_dir / f"last-{FAILED_START}.json"
    if read_json(last) == report:
        atomic_write(last, data)


def _host() -> str:
    import socket

    return socket.gethostname()


def recent_crashes(state_dir: Path, limit: int = 10) -> list[dict[str, Any]]:
    """Crash records, oldest first (at most `limit`): reports of crashed starts and crashes while
    serving, and journals of dead processes not settled yet (read only: nothing is written)."""
    rows = []
    try:
        names = [p for p in (state_dir / "reports").iterdir()
                 if p.name.startswith((f"{FAILED_START}-", f"{CRASH}-")) and p.suffix == ".json"]
    except OSError:
        names = []
    for path in names:
        r = read_json(path)
        if r is not None and (r.get("result") in (CRASHED, TIMEOUT) or path.name.startswith(f"{CRASH}-")):
            rows.append(_row(r, path.name))
    rows += [_row(crash_report(j), j.path.name, settled=False) for j in journals(state_dir)
             if not j.alive() and j.end is None]
    rows.sort(key=lambda r: r["ended_unix"] or r["started_unix"] or 0)
    return rows[-limit:]


def _row(r: dict[str, Any], name: str, settled: bool = True) -> dict[str, Any]:
    ended = r.get("ended_unix") if isinstance(r.get("ended_unix"), (int, float)) else None
    at = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ended)) if ended is not None else r.get("started_at")
    return {"at": at, "ended_unix": ended, "started_at": r.get("started_at"), "started_unix": r.get("started_unix"),
            "pid": r.get("pid"),
            "result": r.get("result", CRASHED), "phase": r.get("phase"), "model": r.get("model"),
            "engine": r.get("engine"), "signal": r.get("signal"), "exit_status": r.get("exit_status"),
            "service_result": r.get("service_result"), "cause": r.get("cause") or cause_of(
                r.get("signal"), str(r.get("service_result") or ""), r.get("exit_status")),
            "reached_ready": r.get("reached_ready", False),
            "keys": r.get("keys") or {}, "error": r.get("error"), "record": name, "settled": settled}
