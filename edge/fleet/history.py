"""What this device's starts, reloads and OTA installs did, as its state dir keeps it across restarts.

The state dir already holds the reports (edge.timing: `reports/start-*.json`,
`reports/reload-*.json`, `last-start.json`, `last-reload.json`); a start that fails leaves
`reports/failed-start-*.json` (`record_failed_start`, on the failure path only, so a good start
pays nothing), with its `result`: failed, stopped (SIGTERM before READY), crashed or timeout (from
its journal: edge.fleet.crashes); a process that died after READY leaves `reports/crash-*.json`. Reports are pruned (the newest 50 of each kind), so counts cannot be read from
them alone: `Ledger` adds every report once to counts that only grow, kept in `history.json`
beside them, and remembers which reports it counted for as long as they are on disk.

A report is counted once by its identity, not its file name: a reload writes its report twice
(at the switch and again after the drain), under two names when the second write falls in the
next second. The OTA state (`ota/state.json`, edge.ota.install's truth) is only read here, never
written, and a missing or unreadable one is "no OTA on this device", never an error.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.fsutil import atomic_write
from edge.timing import write_report

__all__ = ["AFTER_READY", "CRASH", "FAILED_START", "LEDGER", "START_RESULTS", "Ledger", "OtaView", "read_json", "read_ota", "record_failed_start",
           "reload_result", "timestamp"]

log = logging.getLogger("edge")

LEDGER = "history.json"
LEDGER_FORMAT = 1
FAILED_START = "failed-start"  # the report kind of a start that never reached READY
CRASH = "crash"  # the report kind of a process that died after READY (edge.fleet.crashes)
# how a start ended: READY, or before it by an error, a SIGTERM, a signal, systemd's timeout; or
# it found safe mode exhausted and only answered (edge.fleet.giveup)
START_RESULTS = ("ok", "failed", "stopped", "crashed", "timeout", "given_up")
_KINDS = ("start", FAILED_START, "reload", CRASH)  # report kinds (file prefixes under reports/)
AFTER_READY = "after_ready"  # the events' family of a crash while serving (a crashed start is a "start")
RECENT_S = 24 * 3600  # how long history.json keeps each counted event's time (edge.fleet.metrics' windows)
MAX_EVENTS = 2000  # at most this many of them (a boot loop restarting every second is past any alert)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def timestamp(text: Any) -> float | None:
    """Unix seconds of a report's `started_at` or an OTA event's `at` (ISO 8601 with offset or Z)."""
    if not isinstance(text, str):
        return None
    try:
        import datetime  # here: imported before the config

        return datetime.datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def reload_result(report: dict[str, Any]) -> str:
    """ok: the new set serves; failed: the old set kept serving (or, when even loading it again
    failed, the service stopped); rolled_back: a sequential reload failed after the old set was
    freed, and the old config was loaded again."""
    if not report.get("error"):
        return "ok"
    return "rolled_back" if report.get("rolled_back") else "failed"


def _counted(kind: str, report: dict[str, Any]) -> list[tuple[str, str]]:
    """(family, key) counters one report adds to: a start's result; a reload's; and every crash,
    before READY or after, under "crash" by "<phase>/<signal>/<cause>" (edge.fleet.crashes)."""
    if kind == "reload":
        if report.get("reload_kind") == "process":  # a handover to a new process: a reload too
            result = reload_result(report)
            how = "restart" if result == "ok" and report.get("mode") == "restart" else result
            return [("reload", result), ("handover", how)]
        return [("reload", reload_result(report))]
    if kind == "start":
        return [("start", "ok")]
    cause = report.get("cause") or "unknown"
    crash = [("crash", f"{report.get('phase') or 'unknown'}/{report.get('signal') or 'unknown'}/{cause}")]
    if kind == CRASH:
        return crash
    result = report.get("result") if report.get("result") in START_RESULTS[1:] else "failed"
    return [("start", result)] + (crash if result == "crashed" else [])


def _identity(kind: str, name: str, report: dict[str, Any]) -> str:
    if kind != "reload":
        return name  # written once
    # the switch and the drain write the same reload: one timer, one start to the microsecond
    if isinstance(report.get("started_unix"), (int, float)):
        return f"reload/{report.get('pid')}/{report['started_unix']}"
    end = report.get("switch_s")  # reports of edge before started_unix: pid, start, switch offset
    return f"reload/{report.get('pid')}/{report.get('started_at')}/{end if end is not None else report.get('ready_s')}"


@dataclass
class Ledger:
    """Counts of starts and reloads by result, kept in `<state_dir>/history.json` and brought up
    to date from the reports on each `update()` (a scrape, or a failed start)."""

    state_dir: Path
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # report file name -> its identity
    # (unix time, family, key) of what was counted in the last RECENT_S: the windows of recent()
    events: list[tuple[float, str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _loaded: bool = False
    _warned: bool = False

    @property
    def path(self) -> Path:
        return self.state_dir / LEDGER

    def update(self) -> dict[str, dict[str, int]]:
        """Count the reports not counted yet; the counts (kind -> result -> n)."""
        with self._lock:  # two scrapes at once must not count one report twice
            if not self._loaded:
                self._load()
            on_disk = dict(self._reports())
            new = {n: k for n, k in on_disk.items() if n not in self.seen}
            known = set(self.seen.values())
            for name, kind in sorted(new.items()):
                report = read_json(self.state_dir / "reports" / name)
                if report is None:
                    continue  # half-gone (pruned meanwhile) or foreign: not counted, looked at again
                ident = _identity(kind, name, report)
                if ident not in known:
                    at = _happened(report, self.state_dir / "reports" / name)
                    for family, key in _counted(kind, report):
                        counts = self.counts.setdefault(family, {})
                        counts[key] = counts.get(key, 0) + 1
                        self.events.append((at, AFTER_READY if kind == CRASH else family, key))
                    known.add(ident)
                self.seen[name] = ident
            gone = [n for n in self.seen if n not in on_disk]
            for n in gone:
                del self.seen[n]  # pruned: it cannot come back, so it need not be remembered
            horizon = time.time() - RECENT_S
            old = len(self.events)
            self.events = sorted(e for e in self.events if e[0] >= horizon)[-MAX_EVENTS:]
            if new or gone or len(self.events) != old:
                self._save()
            return {k: dict(v) for k, v in self.counts.items()}

    def recent(self, window_s: float, now: float | None = None) -> dict[str, dict[str, int]]:
        """What was counted in the last `window_s` seconds (as of the last update()), by when it
        happened on this device: family -> key -> n. A scrape gap, a new Prometheus, a recount
        of the reports or a device back from offline changes none of it."""
        until = time.time() if now is None else now
        since = until - window_s
        out: dict[str, dict[str, int]] = {}
        for at, family, key in self.events:
            if since <= at <= until:
                out.setdefault(family, {})[key] = out.setdefault(family, {}).get(key, 0) + 1
        return out

    def _reports(self) -> Iterator[tuple[str, str]]:
        try:
            names = [p.name for p in (self.state_dir / "reports").iterdir()]
        except OSError:
            return
        for name in names:
            kind = name.rsplit("-", 2)[0] if name.endswith(".json") else ""
            if kind in _KINDS:  # <kind>-<stamp>-<pid>.json
                yield name, kind

    def _load(self) -> None:
        data = read_json(self.path) if self.path.exists() else {}
        counts, seen = (data.get("counts"), data.get("seen")) if isinstance(data, dict) else (None, None)
        if not isinstance(data, dict) or data and (data.get("format") != LEDGER_FORMAT or not isinstance(
                counts, dict) or not isinstance(seen, dict)):
            log.warning("%s is not an edge history ledger (format %s): counting from the reports "
                        "on disk again", self.path, LEDGER_FORMAT)
            counts, seen = {}, {}
        self.counts = {str(k): {str(r): int(n) for r, n in v.items() if isinstance(n, int)}
                       for k, v in (counts or {}).items() if isinstance(v, dict)}
        self.seen = {str(k): str(v) for k, v in (seen or {}).items()}
        events = data.get("events") if isinstance(data, dict) and counts else None
        self.events = [(float(e[0]), str(e[1]), str(e[2])) for e in events or []
                       if isinstance(e, list) and len(e) == 3 and isinstance(e[0], (int, float))]
        self._loaded = True

    def _save(self) -> None:
        data = {"format": LEDGER_FORMAT, "counts": self.counts, "seen": self.seen,
                "events": [list(e) for e in self.events]}
        try:
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError as exc:  # the counts still serve from memory; the next update tries again
            if not self._warned:
                log.warning("cannot write %s (%s): start and reload counts will not survive a restart",
                            self.path, exc)
                self._warned = True


def _happened(report: dict[str, Any], path: Path) -> float:
    """When a report's event happened on this device: when it ended where the record says
    (`ended_unix`: a crash, by systemd's word or its own, edge.fleet.crashes), else its start
    plus how long it ran (a start that failed before READY), else its file's time; never the
    time it was counted (a recount of old reports must not look like new failures)."""
    if isinstance(report.get("ended_unix"), (int, float)):
        return float(report["ended_unix"])
    start = report.get("started_unix")
    if not isinstance(start, (int, float)):
        start = timestamp(report.get("started_at"))
    if isinstance(start, (int, float)):
        ran = report.get("ready_s")
        return float(start) + (float(ran) if isinstance(ran, (int, float)) and ran > 0 else 0.0)
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def record_failed_start(state_dir: Path, report: dict[str, Any], count: bool = True) -> Path | None:
    """Keep the report of a start that failed (reports/failed-start-*.json and
    last-failed-start.json; last-start.json stays the last good start) and count it at once
    (`count`): a service that keeps failing is not scraped, and its reports are pruned meanwhile.
    A start stopped by SIGTERM is counted later, once systemd said whether it was its timeout."""
    try:
        path = write_report(report, state_dir, kind=FAILED_START)
    except OSError as exc:  # e.g. the state dir itself is what failed the start
        log.warning("cannot record the failed start in %s: %s", state_dir, exc)
        return None
    if count:
        Ledger(state_dir).update()
    return path


@dataclass(frozen=True)
class OtaView:
    """The OTA state as `edge ota status` shows it: versions and the last event."""

    current: str | None
    previous: str | None
    pending: str | None
    highest: str | None
    last_event: str | None  # committed | rolled back | rollback unhealthy | staged | unknown
    last_version: str | None
    last_at: float | None  # unix seconds


# history events that end no install (edge.ota.install writes them beside the install events)
_NOT_INSTALLS = ("state rebuilt", "repaired")
# a version's .complete marker state -> the install event it stands for (edge.ota.rebuild's reading;
# committed is one only after a history: without one, a rollback after it may have pruned it)
_MARKER_EVENTS = {"failed": "rolled back", "staged": "staged"}


def read_ota(state_dir: Path) -> OtaView | None:
    """`<state_dir>/ota/state.json`, read only; None where there is no OTA. Where it is damaged
    or lost, what `edge ota recover` will rebuild: state.json.prev (the state before the last
    write), then the `.complete` markers newer than its last event, so the last result stays
    shown until then (edge.ota.rebuild makes the same reading and writes it)."""
    root = state_dir / "ota"
    st = read_json(root / "state.json")
    if st is not None:
        return _view(st, None)
    prev, marker = read_json(root / "state.json.prev"), _newest_marker(root)
    if prev is None and marker is None:
        if (root / "state.json").exists():
            log.debug("%s is not readable JSON: no OTA metrics", root / "state.json")
        return None
    link = os.readlink(root / "current") if (root / "current").is_symlink() else ""
    return _view(prev or {"current": link.rpartition("/")[2]}, marker)  # no slot left: the link says it


def _view(st: dict[str, Any], marker: tuple[str, bool, str, str] | None) -> OtaView:
    def text(v: Any) -> str | None:
        return v if isinstance(v, str) and v else None

    pending = st.get("pending")
    history = st.get("history") if isinstance(st.get("history"), list) else []
    # the last install event: a state rebuild's note and a repair in place are none
    last = next((e for e in reversed(history) if isinstance(e, dict) and e.get("event") not in _NOT_INSTALLS), {})
    if marker is not None and marker[0] >= str(last.get("at") or ""):
        at, _, version, state = marker  # a marker written after the last event it has: the newer one
        event = _MARKER_EVENTS.get(state, "committed" if last else "unknown")  # no history: no proof
        if (version, event) != (last.get("version"), last.get("event")):
            last = {"version": version if event != "unknown" else None, "event": event,
                    "at": at if event != "unknown" else None}
            if event != "staged" and isinstance(pending, dict) and pending.get("version") == version:
                pending = None  # that install ended after the slot was written
    return OtaView(current=text(st.get("current")), previous=text(st.get("previous")),
                   pending=text(pending.get("version")) if isinstance(pending, dict) else None,
                   highest=text(st.get("highest")), last_event=text(last.get("event")),
                   last_version=text(last.get("version")), last_at=timestamp(last.get("at")))


def _newest_marker(root: Path) -> tuple[str, bool, str, str] | None:
    """(at, failed, version, state) of the newest `.complete` marker (a failure first within one
    second, as the rebuild orders them); None without one that says when."""
    markers = []
    for marker in sorted(root.glob("versions/*/.complete")):
        try:
            lines = marker.read_text().split("\n")
        except (OSError, UnicodeDecodeError):
            continue
        version, state, at = ((lines + ["", "", ""])[:3])
        if at.strip():
            markers.append((at.strip(), state.strip() == "failed", version.strip(), state.strip()))
    return max(markers, default=None)
