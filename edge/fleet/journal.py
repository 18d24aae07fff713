"""The start journal: how far each edge process got, written down before each phase runs, so that
a process that dies by a signal (a native fault, the OOM killer, SIGKILL, a watchdog abort) still
leaves a trace that says where.

One file per process, `<state_dir>/journal/<pid>-<starttime>.jsonl`, one JSON object a line:

    {"journal": 1, "pid": 4242, "starttime": 812345, "started_at": "…", ...}
    {"enter": "config", "t": 0.181}                    # written before the phase runs
    {"keys": {"llama:gemma": "9f2c…", ...}}            # what each safe-mode ladder is keyed by
    {"enter": "warmup", "t": 1.045, "model": "gemma"}
    {"done": "warmup", "t": 1.150}                     # written, not synced
    {"ready": 1.189}
    {"healthy": 301.2}                                 # served [recovery] healthy_after_s
    {"end": "ok", "exit": 0}                           # the process's own end, when it had one
    {"stop": {"result": "signal", "code": "killed", "status": "SEGV"}}   # systemd's ExecStopPost

The process holds an exclusive lock (flock) on its journal for as long as it is open: the
kernel drops it when the process dies however it dies, and no reboot keeps it, so "its process
is gone" is a lock that can be taken, whatever the pid namespace or the wall clock says.
A line is the kernel's once `write()` returns: a process that dies by any signal leaves every
line it wrote. `fdatasync` only guards them against the machine going down (power cut, kernel
panic, a hardware watchdog during a start) and costs ~3 ms a call on a VM's disk, more on eMMC, so
a thread (`_Syncer`) makes each line durable while its phase runs, off the start's path; `end`
is synced before the process exits.
A process that ends by itself writes `end` (and its report, as before). One that dies by a
signal writes nothing more: its journal has no `end`. systemd's ExecStopPost= (`edge
record-stop`) adds how systemd saw the end, so the signal is known even when the process could
write nothing. Once its process is gone, edge.fleet.crashes turns a journal into a crash record
and removes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.device.cgroup import oom_kills
from edge.fsutil import fsync_dir, private_dir
from edge.timing import process_age_s

__all__ = ["JOURNAL_DIR", "Journal", "JournalRead", "Stop", "journals", "pending", "read_journal"]

log = logging.getLogger("edge")

JOURNAL_DIR = "journal"
FORMAT = 1
NONE, SOON, NOW = "none", "soon", "now"  # a line's fdatasync: none, by the syncer thread, inline


class _Syncer:
    """fdatasync of the journal in a thread of its own, on a duplicate of its descriptor, as soon
    as a line asks for it: the start goes on with its phase meanwhile. Lines written while a sync
    runs are taken by the next one."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)
        os.set_inheritable(self.fd, False)
        self.spent, self.count = 0.0, 0
        self.pending = False  # a line written since the last sync asked for one
        self._wanted = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="edge-journal-sync", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self.pending = True
        self._wanted.set()

    def stop(self) -> None:
        """The sync still asked for made, then the descriptor closed (a thread stuck on a hung
        disk is left to itself)."""
        self._stopped = True
        self._wanted.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                if self.pending:
                    self.pending = False
                    t0 = time.perf_counter()
                    try:
                        os.fdatasync(self.fd)
                    except OSError:
                        return  # the journal's writer says why, once, when its own write fails
                    self.spent += time.perf_counter() - t0
                    self.count += 1
                if self._stopped:
                    return
        finally:
            os.close(self.fd)


def _starttime(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when there is no such process:
    with the pid it names one process, never a later one that reused the pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Journal:
    """This process's journal. Every method is best effort: a journal that cannot be written
    costs the trace, never the start (the reason is logged once)."""

    def __init__(self, state_dir: Path, kind: str = "start", *, clock: Any = None) -> None:
        self.folder = state_dir / JOURNAL_DIR
        self.kind = kind
        self._clock = clock or (lambda: process_age_s())
        self.pid = os.getpid()
        start = _starttime(self.pid) or 0
        self.path = self.folder / f"{self.pid}-{start}.jsonl"
        self._fd: int | None = None
        self._syncer: _Syncer | None = None
        self._failed = False
        self.lines, self.seconds = 0, 0.0  # what the journal cost this process (in its start report)
        self.ended = False
        now = time.time()
        self._write({"journal": FORMAT, "kind": kind, "pid": self.pid, "starttime": start,
                     "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now - self._clock())),
                     "started_unix": round(now - self._clock(), 6), "edge_version": _version(),
                     "oom_kills": oom_kills()}, sync=SOON)  # its cgroup's OOM kills so far (edge.fleet.crashes)

    def enter(self, phase: str, **detail: Any) -> None:
        """A phase begins: written before it runs (durable while it runs)."""
        self._write({"enter": phase, "t": round(self._clock(), 4), **_plain(detail)}, sync=SOON)

    def done(self, phase: str) -> None:
        self._write({"done": phase, "t": round(self._clock(), 4)}, sync=NONE)

    def observe(self, event: str, phase: str, detail: dict[str, Any]) -> None:
        """A StartTimer's observer (edge.timing.PhaseObserver)."""
        if event == "enter":
            self.enter(phase, **detail)
        else:
            self.done(phase)

    def keys(self, keys: dict[str, str]) -> None:
        self._write({"keys": keys}, sync=SOON)

    def ready(self) -> None:
        self._write({"ready": round(self._clock(), 4)}, sync=SOON)

    def healthy(self) -> None:
        self._write({"healthy": round(self._clock(), 4)}, sync=NONE)

    def end(self, result: str, exit_code: int, **detail: Any) -> None:
        """How this process ended by itself: ok (served, then stopped), failed, stopped (SIGTERM
        before READY), crashed (it found itself unfit to go on, e.g. a poisoned CUDA context).
        The first word is the one kept."""
        if self.ended:
            return
        self._write({"end": result, "exit": exit_code, "t": round(self._clock(), 4), **_plain(detail)}, sync=NOW)
        self.ended = True
        self.close()

    def cost(self) -> dict[str, Any]:
        """What the journal cost: `seconds` on the start's path (writes, and syncs made inline),
        `sync_seconds` and `syncs` in the thread, beside the phases."""
        syncer = self._syncer
        return {"lines": self.lines, "seconds": round(self.seconds, 4),
                "sync_seconds": round(syncer.spent, 4) if syncer else 0.0, "syncs": syncer.count if syncer else 0}

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.stop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def move_to(self, state_dir: Path) -> None:
        """The journal into another state dir (the config named another than the one guessed
        before it was read): the lines so far copied, then the old file removed."""
        old, self.folder = self.path, state_dir / JOURNAL_DIR
        self.path = self.folder / old.name
        self.close()
        try:
            lines = old.read_bytes()
        except OSError:
            lines = b""
        self._failed = False
        self._append(lines, sync=NOW)
        old.unlink(missing_ok=True)

    def _write(self, line: dict[str, Any], sync: str) -> None:
        self._append((json.dumps(line, separators=(",", ":")) + "\n").encode(), sync)

    def _append(self, data: bytes, sync: str) -> None:
        if self._failed:
            return
        t0 = time.perf_counter()
        try:
            if self._fd is None:
                private_dir(self.folder)  # how each process ended: crash details
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "alive" for as long as it is held
                fsync_dir(self.folder)
                self._syncer = _Syncer(self._fd)
            os.write(self._fd, data)
            if sync == NOW:
                os.fdatasync(self._fd)
                if self._syncer is not None:
                    self._syncer.pending = False
            elif sync == SOON and self._syncer is not None:
                self._syncer.kick()
            self.lines += 1
            self.seconds += time.perf_counter() - t0
        except OSError as exc:
            self._failed = True
            log.warning("cannot write the start journal %s (%s): a crash of this process will leave no "
                        "trace", self.path, exc)


def _plain(detail: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in detail.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _version() -> str:
    from edge import __version__

    return __version__


@dataclass
class Stop:
    """How systemd saw the main process end ($SERVICE_RESULT, $EXIT_CODE, $EXIT_STATUS of
    ExecStopPost=): result success|exit-code|signal|core-dump|timeout|watchdog|oom-kill|…;
    code exited|killed|dumped; status an exit status or a signal name (SEGV); `oom_kills` the
    unit's cgroup's OOM kills so far (ExecStopPost= runs in it), to compare with the start's; `at`
    when it ran (systemd runs it as soon as the main process is gone: when the crash happened)."""

    result: str = ""
    code: str = ""
    status: str = ""
    oom_kills: int | None = None
    at: float | None = None  # unix time systemd ran ExecStopPost=: right after the process ended

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Stop":
        return cls(env.get("SERVICE_RESULT", ""), env.get("EXIT_CODE", ""), env.get("EXIT_STATUS", ""), oom_kills(),
                   time.time())

    def as_dict(self) -> dict[str, str]:
        return {"result": self.result, "code": self.code, "status": self.status}

    @property
    def signal(self) -> str | None:
        return self.status if self.code in ("killed", "dumped") and self.status else None


@dataclass
class JournalRead:
    """One journal, read back."""

    path: Path
    head: dict[str, Any]
    entered: list[dict[str, Any]] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    keys: dict[str, str] = field(default_factory=dict)
    ready: float | None = None
    healthy: bool = False
    end: dict[str, Any] | None = None
    stop: Stop | None = None
    last_t: float = 0.0

    @property
    def pid(self) -> int:
        return int(self.head.get("pid") or 0)

    def alive(self) -> bool:
        """Its process still holds the journal's lock (it runs, and has not ended its journal)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def phase(self) -> dict[str, Any]:
        """Where it was: the phase entered last among those not done, a model's or engine's own
        phase first (parallel phases: which one faulted); after READY, a reload's phase that was
        under way, else "serving"."""
        entered = [e for e in self.entered if e.get("after_ready")] if self.ready is not None else self.entered
        open_ = [e for e in entered if e["enter"] not in self.finished]
        if self.ready is None:
            open_ = open_ or entered[-1:]
        targeted = [e for e in open_ if "model" in e or "engine" in e]
        return (targeted or open_ or [{"enter": "serving" if self.ready is not None else "exec"}])[-1]


def read_journal(path: Path) -> JournalRead | None:
    """A journal from its lines (a torn last line, from a crash mid-write, is skipped); None when
    the file is not one."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    if not rows or rows[0].get("journal") != FORMAT:
        return None
    j = JournalRead(path, rows[0])
    for row in rows[1:]:
        _apply(j, row)
    return j


def _apply(j: JournalRead, row: dict[str, Any]) -> None:
    if isinstance(row.get("t"), (int, float)):
        j.last_t = float(row["t"])
    if isinstance(row.get("enter"), str):
        j.entered.append({**row, "after_ready": j.ready is not None})
        j.finished.discard(row["enter"])
    elif isinstance(row.get("done"), str):
        j.finished.add(row["done"])
    elif isinstance(row.get("keys"), dict):
        j.keys.update({str(k): str(v) for k, v in row["keys"].items()})
    elif isinstance(row.get("ready"), (int, float)):
        j.ready = j.last_t = float(row["ready"])
    elif "healthy" in row:
        j.healthy = True
    elif isinstance(row.get("end"), str):
        j.end = row
    elif isinstance(row.get("stop"), dict):
        j.stop = Stop(**{k: str(row["stop"].get(k, "")) for k in ("result", "code", "status")})


def journals(state_dir: Path) -> Iterator[JournalRead]:
    try:
        paths = sorted((state_dir / JOURNAL_DIR).glob("*.jsonl"))
    except OSError:
        return
    for path in paths:
        j = read_journal(path)
        if j is not None:
            yield j


def pending(state_dir: Path) -> list[JournalRead]:
    """Journals of processes that are gone and were not settled yet (read only: `edge status`)."""
    return [j for j in journals(state_dir) if not j.alive()]
