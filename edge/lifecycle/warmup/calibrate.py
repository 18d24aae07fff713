"""Calibration: which warm-up candidates pay a first-use cost, measured by running each twice.

Each candidate runs once, then as the same shape with other tokens (its repeat). Its first run
is kept as a warm-up step only when it is slower than the repeat by more than the threshold of
`KeepRule`, and not because this process waited for a CPU: the time its threads spent runnable
but not running (the sum of run_delay, field 2 of /proc/self/task/*/schedstat) is read before and
after each run, and the excess of the first run's waiting over the repeat's is taken off the
gain. A busy machine then makes no step "lazy" (on a first start after boot, chat once measured
0.313 s first vs 0.133 s repeat with nothing lazy on this CPU). Where the kernel has no schedstat
(no CONFIG_SCHED_INFO) the rule is the plain one, and each row says so.

After READY (edge.lifecycle.warmup.after_ready) calibration runs in idle time and gives way to clients: a
client request arriving cancels the running candidate, and that candidate and every one after it
stays pending ("not measured: a request came"), measured at a later start's idle time. A request
may have run a candidate's shape already, so nothing measured after one is trusted.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge.lifecycle.warmup.steps import Candidate, LoopbackHTTP, WarmupStep, run_step

__all__ = ["KeepRule", "Requests", "calibrate", "keep_row", "run_delay"]

TASKS = "/proc/self/task"
NOT_MEASURED = "not measured: a request came"


def run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (their
    schedstat run_delay, summed); None where the kernel keeps no schedstat. A thread that ended
    takes its share with it: a short-lived thread's waiting is not counted."""
    total, seen = 0, False
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"{TASKS}/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # the thread ended between listdir and open
            continue
    return total / 1e9 if seen else None


@dataclass(frozen=True)
class KeepRule:
    """A step is kept when (first - repeat) - max(0, waited_first - waited_repeat) >
    max(min_gain_s, min_gain_ratio x repeat)."""

    min_gain_s: float
    min_gain_ratio: float

    def threshold(self, repeat_s: float) -> float:
        return max(self.min_gain_s, self.min_gain_ratio * repeat_s)


class Requests(Protocol):
    """Client requests, as calibration after READY sees them (edge.lifecycle.warmup.after_ready.Watch)."""

    def came(self) -> bool: ...  # a client request was admitted since READY (or the set is going away)

    async def arrival(self) -> None: ...  # returns when one is


class _Estimator:
    """Predicts a request's seconds from the median seconds-per-work of the repeats measured so
    far (the median: one repeat slowed by another process must not skip the rest)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def add(self, work: int, seconds: float) -> None:
        self.rates.append(seconds / max(1, work))

    def predict(self, work: int) -> float | None:
        return sorted(self.rates)[len(self.rates) // 2] * work if self.rates else None


async def _timed(http: LoopbackHTTP, name: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One run, with the CPU waiting of this process over it (None: no schedstat)."""
    before = run_delay()
    out = await run_step(http, name, path, body)
    after = run_delay()
    out["waited_s"] = None if before is None or after is None else round(max(0.0, after - before), 4)
    return out


async def _pair(http: LoopbackHTTP, step: WarmupStep, requests: Requests | None
                ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    first = await _timed(http, step.name, step.path, step.body)
    if requests is not None and requests.came():
        return None
    repeat = await _timed(http, f"{step.name}.repeat", step.path, step.repeat or step.body)
    return first, repeat


async def _unless_a_request(pair: Awaitable[Any], requests: Requests | None) -> Any:
    """The pair, or None when a client request came first (the pair is cancelled: its request
    ends at the model's next step, and the client's is not held behind it)."""
    if requests is None:
        return await pair
    running = asyncio.ensure_future(pair)
    came = asyncio.ensure_future(requests.arrival())
    try:
        await asyncio.wait({running, came}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        came.cancel()
    if not running.done() or requests.came():
        running.cancel()
        await asyncio.wait({running})
        return None
    return running.result()


async def calibrate(http: LoopbackHTTP, candidates: list[Candidate], rule: KeepRule, budget_s: float,
                    build: Callable[[Callable[[], WarmupStep]], Awaitable[WarmupStep]],
                    requests: Requests | None = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Run each candidate twice (first, then the same shape with other tokens) while the
    predicted cost fits the budget: (one row per candidate, the kept steps, every request that
    ran). `build` makes a candidate's step where it must be made (a model's worker thread).
    `requests` (after READY): from the first client request on, candidates are pending."""
    rows: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    ran: list[dict[str, Any]] = []
    est, t0 = _Estimator(), time.perf_counter()
    for cand in candidates:
        row: dict[str, Any] = {"name": cand.name, "path": cand.path, "kept": False}
        rows.append(row)
        left, guess = budget_s - (time.perf_counter() - t0), est.predict(cand.work)
        if requests is not None and requests.came():
            row.update(pending=True, why=NOT_MEASURED)
            continue
        if left <= 0 or (guess is not None and 2 * guess > left):
            row["why"] = (f"over budget: ~{2 * guess:.2f} s predicted, {max(left, 0):.2f} s left"
                          if guess is not None else "over budget")
            continue
        step = await build(cand.build)
        runs = await _unless_a_request(_pair(http, step, requests), requests)
        if runs is None:
            row.update(pending=True, why=NOT_MEASURED)
            continue
        first, repeat = runs
        ran += [first, repeat]
        est.add(cand.work, repeat["seconds"])
        keep_row(row, first, repeat, rule)
        if row["kept"]:
            kept.append({"name": step.name, "path": step.path, "body": step.body,
                         "first_s": first["seconds"], "repeat_s": repeat["seconds"]})
    return rows, kept, ran


def keep_row(row: dict[str, Any], first: dict[str, Any], repeat: dict[str, Any], rule: KeepRule) -> dict[str, Any]:
    """The keep rule on one candidate's two runs (each with its `seconds` and `waited_s`)."""
    gain, need = first["seconds"] - repeat["seconds"], rule.threshold(repeat["seconds"])
    w1, w2 = first.get("waited_s"), repeat.get("waited_s")
    waited = 0.0 if w1 is None or w2 is None else max(0.0, w1 - w2)
    kept = gain - waited > need
    why = (f"first run {gain * 1000:.1f} ms slower than the repeat"
           + (f", {waited * 1000:.1f} ms of it waiting for a CPU" if waited else "")
           + f" {'>' if kept else '<='} threshold {need * 1000:.1f} ms"
           + (" (no schedstat: waiting for a CPU not counted)" if w1 is None or w2 is None else ""))
    row.update(first_s=first["seconds"], repeat_s=repeat["seconds"], delay_first_s=w1, delay_repeat_s=w2,
               gain_s=round(gain, 4), waited_s=round(waited, 4), threshold_s=round(need, 4), kept=kept, why=why)
    for k in ("prompt_tokens", "completion_tokens", "events", "output_shapes"):
        if k in first:
            row[k] = first[k]
    return row
