"""The stored warm-up plan: which steps calibration kept, keyed by what decides what is lazy.

A plan is measured once per key and replayed by every later start with the same key. The key
holds everything that changes which first-time costs exist: the model's content (its sha256, or
path + size + mtime when no sha256 is configured; `model_id` says which), the device identity
(as for engines: edge.device.identity.detect), the llama.cpp / llama-cpp-python version and its CPU
features, the backend build (cpu / cuda), n_ctx, n_batch, n_ubatch, n_gpu_layers; for an engine,
the stored engine's key. One file per model or engine under <cache_dir>/warmup/, written
atomically. A file that cannot be read, is not a plan, or was made for another key is ignored
(with the reason) and the start calibrates anew: never a crash.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import WarmupConfig
from edge.fsutil import atomic_write, private_dir
from edge.model.identity import context_identity, device_identity, key_differences
from edge.lifecycle.warmup.calibrate import KeepRule, Requests, calibrate
from edge.lifecycle.warmup.steps import Candidate, LoopbackHTTP, WarmupStep, run_step, run_steps

if TYPE_CHECKING:
    from edge.device.identity import DeviceInfo
    from edge.model.llm import GGUFModel

__all__ = ["PLAN_FORMAT", "Later", "Plan", "PlanStore", "WarmResult", "after_ready", "engine_plan_key",
           "finish_later", "model_plan_key", "warm_one"]

log = logging.getLogger("edge")

PLAN_FORMAT = 1
def model_plan_key(model: GGUFModel, device: DeviceInfo, build: str | None) -> dict[str, Any]:
    # an embeddings context's settings only where the model has one: other models' keys unchanged
    embed = model.embed.describe() if model.embed is not None else None
    return {"kind": "model", **context_identity(model, build), "device": device_identity(device),
            **({"embeddings": {k: embed[k] for k in ("pooling", "n_batch", "flash_attn")}} if embed else {})}


def engine_plan_key(engine_key: dict[str, Any], device: DeviceInfo) -> dict[str, Any]:
    return {"kind": "engine", "engine_key": engine_key, "device": device_identity(device)}


@dataclass
class Plan:
    """Kept steps (name, path, body, first_s, repeat_s) and every candidate's calibration row;
    a row with `pending` was not measured yet (a request came): a later start measures it."""

    key: dict[str, Any]
    steps: list[dict[str, Any]]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    calibrated_at: str = ""

    def pending(self) -> list[str]:
        return [c["name"] for c in self.candidates if c.get("pending")]

    def merged(self, rows: list[dict[str, Any]], kept: list[dict[str, Any]]) -> Plan:
        """This plan with the rows of a calibration of some of its candidates put in their place."""
        new = {r["name"]: r for r in rows}
        names = [c["name"] for c in self.candidates]
        candidates = [new.get(c["name"], c) for c in self.candidates] + [r for r in rows if r["name"] not in names]
        return Plan(self.key, self.steps + kept, candidates)

    def as_dict(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "key": self.key, "calibrated_at": self.calibrated_at,
                "steps": self.steps, "candidates": self.candidates}


class PlanStore:
    """<cache_dir>/warmup/<kind>-<name>.json, one plan per model or engine."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, kind: str, name: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.folder / f"{kind}-{safe}.json"

    def load(self, kind: str, name: str, key: dict[str, Any]) -> tuple[Plan | None, str, bool]:
        """(the plan, or None and why a calibration runs, whether that reason is a warning)."""
        path = self.path(kind, name)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, "no stored plan for this model", False
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return None, f"plan file {path} is unreadable or not JSON ({exc}); ignored", True
        problem = _schema_problem(raw)
        if problem:
            return None, f"plan file {path} is not a warm-up plan ({problem}); ignored", True
        if raw["key"] != key:
            diff = "; ".join(key_differences(raw["key"], key)) or "key differs"
            return None, f"new key ({diff})", False
        return Plan(raw["key"], raw["steps"], raw.get("candidates", []), raw.get("calibrated_at", "")), "", False

    def save(self, kind: str, name: str, plan: Plan) -> Path:
        private_dir(self.folder)  # a plan's steps hold the workload's prompts
        plan.calibrated_at = plan.calibrated_at or time.strftime("%Y-%m-%dT%H:%M:%S%z")
        path = self.path(kind, name)
        atomic_write(path, json.dumps(plan.as_dict(), indent=1) + "\n")
        return path


def _schema_problem(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return "expected a JSON object"
    if raw.get("format") != PLAN_FORMAT:
        return f"format {raw.get('format')!r}, expected {PLAN_FORMAT}"
    if not isinstance(raw.get("key"), dict) or not isinstance(raw.get("steps"), list):
        return "expected 'key' (object) and 'steps' (array)"
    for i, s in enumerate(raw["steps"]):
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("path"), str)
                and s["path"].startswith("/") and isinstance(s.get("body"), dict)):
            return f"steps[{i}]: expected name, path and body"
    return None


@dataclass
class WarmResult:
    """What one model's or engine's warm-up did: the start report's account of it."""

    kind: str  # model | engine
    name: str
    plan: str  # calibrated | stored | floor only | calibrating after ready
    why: str
    steps: list[dict[str, Any]]  # every warm-up request that ran, floor first (calibration: both runs)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    left_out: list[dict[str, Any]] = field(default_factory=list)  # plan steps over the budget
    plan_file: str | None = None
    warning: str | None = None
    calibrated_at: str = ""
    later: Later | None = None  # what is left to calibrate after READY

    def as_dict(self) -> dict[str, Any]:
        out = {self.kind: self.name, "plan": self.plan, "why": self.why, "plan_file": self.plan_file,
               "calibrated_at": self.calibrated_at, "candidates": self.candidates,
               "left_out": self.left_out, "kept": [c["name"] for c in self.candidates if c.get("kept")],
               "pending": [c["name"] for c in self.candidates if c.get("pending")]}
        return {**out, **({"warning": self.warning} if self.warning else {})}


@dataclass(frozen=True)
class WarmTarget:
    """One model or engine to warm: its floor, its candidates (made only when calibrating)."""

    kind: str
    name: str
    key: Callable[[], Awaitable[dict[str, Any]]]  # the plan key, found while the floor runs
    floor: WarmupStep
    candidates: Callable[[], Awaitable[list[Candidate]]]
    build: Callable[[Callable[[], WarmupStep]], Awaitable[WarmupStep]]  # where a candidate is made
    also: tuple[WarmupStep, ...] = ()  # floors of the target's other routes (embeddings), after its floor


@dataclass(frozen=True)
class Later:
    """A calibration left for after READY: the plan it adds to, and which candidates (None: all)."""

    target: WarmTarget
    plan: Plan
    names: frozenset[str] | None


def after_ready(cfg: WarmupConfig, key: dict[str, Any]) -> bool:
    """Whether `[warmup] calibrate` puts this target's calibration after READY (see the field)."""
    if cfg.calibrate != "auto":
        return cfg.calibrate == "after_ready"
    return key.get("kind") == "model" and (key.get("n_gpu_layers") == 0 or key.get("backend") == "cpu")


async def warm_one(http: LoopbackHTTP, target: WarmTarget, cfg: WarmupConfig, store: PlanStore, *,
                   recalibrate: bool = False, defer: bool = False,
                   status: Callable[[str], None] = lambda s: None) -> WarmResult:
    """The floor, then the stored plan for this key, or a calibration that makes and stores one.
    `defer` (a start): a calibration `after_ready` puts after READY is left in `later`."""
    floors = [await run_step(http, "floor" if s is target.floor else s.name, s.path, s.body)
              for s in (target.floor, *target.also)]
    for f in floors:
        f["floor"] = True
    floor, floors = floors[0], floors[1:]  # readiness: every route of the target answered once
    key = await target.key()
    if not cfg.enabled:
        return WarmResult(target.kind, target.name, "floor only", "[warmup] enabled = false", [floor, *floors])
    if recalibrate:
        plan, why, warn = None, "recalibration asked for (edge warmup --calibrate)", False
    else:
        plan, why, warn = store.load(target.kind, target.name, key)
    if warn:
        log.warning("warm-up plan of %s: %s", target.name, why)
    path = str(store.path(target.kind, target.name))
    later, steps, left_out = defer and after_ready(cfg, key), [floor, *floors], []
    if plan is not None:
        ran, left_out = await run_steps(http, plan.steps, cfg.budget_s)
        steps += ran
        pending = plan.pending()
        result = WarmResult(target.kind, target.name, "stored", "known key", steps, plan.candidates,
                            left_out, path, calibrated_at=plan.calibrated_at)
        if not pending:
            return result
        if later:
            result.why = f"known key; {len(pending)} candidates pending: calibrating after ready"
            result.later = Later(target, plan, frozenset(pending))
            return result
        status(f"calibrating the warm-up of {target.name}: {len(pending)} candidates pending")
        names: frozenset[str] | None = frozenset(pending)
        why = f"known key; the {len(pending)} pending candidates measured now"
    else:
        plan, names = Plan(key, []), None
        if later:
            status(f"warm-up of {target.name}: {why}; calibrating after ready, plan to {path}")
            return WarmResult(target.kind, target.name, "calibrating after ready", why, steps, [], [], path,
                              why if warn else None, later=Later(target, plan, None))
        status(f"calibrating the warm-up of {target.name}: {why}")
    rule = KeepRule(cfg.min_gain_s, cfg.min_gain_ratio)
    rows, kept, ran = await calibrate(http, _only(await target.candidates(), names), rule, cfg.budget_s,
                                      target.build)
    new, path = _store(store, target, plan.merged(rows, kept), path)
    return WarmResult(target.kind, target.name, "calibrated", why, steps + ran, new.candidates, left_out, path,
                      why if warn else None, new.calibrated_at)


async def finish_later(http: LoopbackHTTP, later: Later, cfg: WarmupConfig, store: PlanStore,
                       requests: Requests) -> WarmResult:
    """A calibration after READY: the candidates left (all, or the pending ones) while no client
    request came, within `after_ready_budget_s`; the plan stored with what is still pending."""
    target = later.target
    rule = KeepRule(cfg.min_gain_s, cfg.min_gain_ratio)
    rows, kept, ran = await calibrate(http, _only(await target.candidates(), later.names), rule,
                                      cfg.after_ready_budget_s, target.build, requests)
    new, path = _store(store, target, later.plan.merged(rows, kept), str(store.path(target.kind, target.name)))
    return WarmResult(target.kind, target.name, "calibrated after ready", "measured in idle time after READY",
                      ran, new.candidates, [], path, calibrated_at=new.calibrated_at)


def _only(candidates: list[Candidate], names: frozenset[str] | None) -> list[Candidate]:
    return candidates if names is None else [c for c in candidates if c.name in names]


def _store(store: PlanStore, target: WarmTarget, plan: Plan, path: str) -> tuple[Plan, str]:
    try:
        store.save(target.kind, target.name, plan)
    except OSError as exc:  # a read-only cache dir costs a calibration per start, not the start
        log.warning("warm-up plan of %s not stored in %s: %s", target.name, path, exc)
        path = f"not stored: {exc}"
    return plan, path
