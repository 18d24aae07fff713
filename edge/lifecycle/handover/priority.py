"""A handover's new process starts at a lower CPU priority, and takes its own back before it serves.

The new process (edge.lifecycle.handover.handover) imports, pages in, loads, locks and warms up on the cores
the old process serves on: at the same priority, every request in flight meanwhile waits for its
share. So its start runs at a higher nice value (`yield_cpu`, first thing in `edge serve`: every
thread started later inherits it), and each of its threads gets the nice value it began with back
(`Yielded.restore`) just before it is ready, while the old process still serves.

Taking a priority back is what an unprivileged process may not do by default: without
CAP_SYS_NICE, a thread may lower its nice value only down to 20 - RLIMIT_NICE, and that limit is 0
unless raised. The unit sets `LimitNICE=+0` (RLIMIT_NICE 20: back to nice 0, never above the
service's own priority), so its DynamicUser= process can. Where a process could not take it back
(`can_restore`), it does not lower it at all (a service stuck at nice 10 would serve slower for
its whole life) and the handover falls back to the warm-up's smaller thread count alone.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

__all__ = ["BASE_NICE_ENV", "HANDOVER_NICE", "Yielded", "can_restore", "lower_child", "successor_yields", "yield_cpu"]

log = logging.getLogger("edge")

# How far the new process's start steps back: at nice +10 the scheduler gives it about a tenth of
# what an equal thread gets (CFS weights 110 vs 1024): out of the serving threads' way, and still
# done within seconds on a busy device (nice 19, weight 15, left it starved under 8 clients).
HANDOVER_NICE = 10
_CAP_SYS_NICE = 23
# The old process lowers the new one right after it spawns it (`lower_child`: its interpreter's
# start and first imports run lowered too, ~0.1 s of CPU), and names the nice value it serves at.
BASE_NICE_ENV = "EDGE_HANDOVER_BASE_NICE"


def can_restore(nice: int) -> bool:
    """Whether this process may set a thread's nice value back to `nice` once it has raised it:
    CAP_SYS_NICE in its effective set, or an RLIMIT_NICE of at least 20 - nice."""
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return True
    try:
        with open("/proc/self/status") as f:
            eff = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        return bool(int(eff, 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        return False


@dataclass
class Yielded:
    """The nice value this process began with, to be taken back by every thread before it serves."""

    nice: int
    lowered_to: int
    failed: list[str] | None = None  # once restored: the threads that could not be

    def as_dict(self) -> dict[str, object]:
        """For the start report: the nice value it began with, the one it started at, what failed."""
        return {"nice": self.nice, "started_at_nice": self.lowered_to, "restore_failed": self.failed}

    def restore(self) -> list[str]:
        """Every thread of this process back to `nice`; what could not be (a thread that is gone is
        no failure), for the log."""
        failed = []
        for tid in _threads():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
            except ProcessLookupError:
                continue
            except OSError as exc:
                failed.append(f"thread {tid}: {exc.strerror}")
        self.failed = failed
        if failed:
            log.warning("handover: could not take the CPU priority back (nice %d): %s", self.nice, "; ".join(failed))
        return failed


def successor_yields() -> bool:
    """Whether a new process this one starts will yield the CPU (`yield_cpu`): it inherits this
    process's nice value, limits and capabilities. The old process's side of a handover then keeps
    serving on all its threads instead of giving a share of the cores to the new one's warm-up."""
    return can_restore(os.getpriority(os.PRIO_PROCESS, 0))


def lower_child(pid: int, by: int = HANDOVER_NICE) -> None:
    """The new process `pid`, just spawned, `by` nice steps below this one (its environment's
    BASE_NICE_ENV names the value it takes back). Only where it can take it back
    (`successor_yields`); a process that is gone already is left alone."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if not can_restore(nice):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, nice + by))
    except OSError:
        pass


def yield_cpu(by: int = HANDOVER_NICE) -> Yielded | None:
    """This thread (and every thread it starts from now on) `by` nice steps below the service's
    nice value (this process's, or the one the old process named: `lower_child` lowered it
    already); None where the priority could not be taken back (then nothing is changed)."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        nice = int(os.environ.pop(BASE_NICE_ENV))
    except (KeyError, ValueError):
        nice = now
    if not can_restore(nice):
        log.info("handover: starting at the service's own CPU priority: nice %d could not be taken back "
                 "(RLIMIT_NICE %d, no CAP_SYS_NICE; the unit's LimitNICE=+0 allows it)", nice,
                 resource.getrlimit(resource.RLIMIT_NICE)[0])
        return None
    lowered = max(now, min(19, nice + by))
    if lowered != now:
        os.setpriority(os.PRIO_PROCESS, 0, lowered)  # Linux: PRIO_PROCESS 0 is the calling thread
    return Yielded(nice, lowered)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
