"""Calibration after READY: off the start's path, in idle time, giving way to clients.

A start whose model calibrates `after_ready` (edge.lifecycle.warmup.plan.after_ready) runs the floor
and the stored steps before READY; what is left (every candidate without a plan, or a plan's
pending ones) is measured here, by a task the start makes once READY=1 is sent:

    wait `after_ready_idle_s` with no client request → the private HTTP transport (edge.lifecycle.warmup.steps.LoopbackHTTP) → each model's
    candidates (first, then repeat) → the plan stored → the start report rewritten, the log line

A client request to any model of the set (ModelWorker.arrivals, warm-up's own not counted) before
the wait ends leaves everything for a later start; one during the calibration cancels the running
candidate, which stays pending with every one after it (edge.lifecycle.warmup.calibrate). SIGTERM,
a handover or a reload's switch cancels the task: what was measured until then is lost, the
plan file is written only whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import Config, cache_dir
from edge.timing import rewrite_report

if TYPE_CHECKING:
    from edge.lifecycle.loadset import Loaded
    from edge.lifecycle.systemd import Notifier
    from edge.serve.worker import ModelWorker

__all__ = ["Watch", "describe", "start_after_ready", "stop_after_ready"]

log = logging.getLogger("edge")


class Watch:
    """Client requests to the set's models, counted from its making on (ModelWorker.arrivals); and
    whether the set is going away (`leaving`: a reload or the drain began), which ends the
    calibration as a request does, before anything more is sent to models a reload may free."""

    def __init__(self, workers: list[ModelWorker], leaving: Callable[[], bool] = lambda: False) -> None:
        self.workers = workers
        self.leaving = leaving
        self.at_ready = self._count()
        self._event = asyncio.Event()
        for w in self.workers:
            w.on_arrival = self._event.set

    def _count(self) -> int:
        return sum(w.arrivals for w in self.workers)

    def came(self) -> bool:
        return self._count() > self.at_ready or self.leaving()

    async def arrival(self) -> None:
        if not self.came():
            await self._event.wait()

    async def quiet(self, seconds: float) -> bool:
        """Whether `seconds` went by with no client request (since READY)."""
        try:
            await asyncio.wait_for(self.arrival(), seconds)
        except asyncio.TimeoutError:
            return not self.came()
        return False

    def close(self) -> None:
        for w in self.workers:
            if w.on_arrival == self._event.set:
                w.on_arrival = None


def describe(loaded: Loaded) -> str:
    """The READY status's words for what calibrates after READY ('' when nothing does)."""
    plans = {p.get("model") or p.get("engine"): p.get("plan_file") for p in loaded.plans}
    names = [f"{x.target.name} (plan to {plans.get(x.target.name)})" for x in loaded.later]
    return f"; calibrating after ready: {', '.join(names)}" if names else ""


def start_after_ready(loaded: Loaded, cfg: Config, notifier: Notifier, report: dict[str, Any], path: Path,
                      watch: Watch) -> asyncio.Task[None] | None:
    """The calibration task, made at READY (None when nothing is left to calibrate). `watch` was
    made before the first accept: a client that waited in the backlog counts."""
    if not loaded.later:
        watch.close()
        return None
    return asyncio.ensure_future(_calibrate(loaded, cfg, watch, notifier, report, path))


async def stop_after_ready(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})


async def _calibrate(loaded: Loaded, cfg: Config, watch: Watch, notifier: Notifier, report: dict[str, Any],
                     path: Path) -> None:
    from edge.lifecycle.warmup.plan import PlanStore, finish_later
    from edge.lifecycle.warmup.steps import LoopbackHTTP

    try:
        if not await watch.quiet(cfg.warmup.after_ready_idle_s):
            log.info("warm-up calibration after ready: a client request came first; a later start measures "
                     "%s", ", ".join(x.target.name for x in loaded.later))
            return
        store = PlanStore(cache_dir(cfg) / "warmup")
        t0 = time.perf_counter()
        async with LoopbackHTTP(loaded.app) as http:
            for later in loaded.later:
                result = await finish_later(http, later, cfg.warmup, store, watch)
                done = result.as_dict()
                loaded.plans[:] = [done if _name(p) == later.target.name else p for p in loaded.plans]
                log.info("warm-up of %s calibrated after ready in %.2f s: kept %s; pending %s; plan %s",
                         later.target.name, time.perf_counter() - t0, ", ".join(done["kept"]) or "none",
                         ", ".join(done["pending"]) or "none", result.plan_file)
        loaded.later.clear()
        _rewrite(report, path, loaded.plans, round(time.perf_counter() - t0, 4))
        notifier.status(f"ready: serving {', '.join(loaded.names)} on {', '.join(report.get('sockets', []))} "
                        f"(start {report.get('ready_s', 0):.2f} s); warm-up calibrated after ready")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the set was replaced or closed meanwhile, a candidate failed: serving goes on
        log.warning("warm-up calibration after ready stopped: %s", exc)
    finally:
        watch.close()


def _name(plan: dict[str, Any]) -> Any:
    return plan.get("model") or plan.get("engine")


def _rewrite(report: dict[str, Any], path: Path, plans: list[dict[str, Any]], seconds: float) -> None:
    """The start report with the calibration's rows, written again (edge.timing.rewrite_report)."""
    report["calibration"] = plans
    report["calibrated_after_ready_s"] = seconds
    rewrite_report(report, path)
