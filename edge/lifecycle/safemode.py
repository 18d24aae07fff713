"""Safe mode: recovery that escalates one step at a time after native crashes, never a silent
crash loop (the model: Android's RescueParty, systemd's boot counting).

A crash record (edge.fleet.crashes) names the phase a process died in and the model or engine it
was working on. Each phase that has a way around a fault belongs to a ladder of fallbacks:

    llama:<model>   model_load, mlock_verify, warm-up of a model, and a reload's load of it;
                    "serving" (a crash after READY) climbs the ladder of every model (llama:*)
                    1. llama.cpp without extra buffer types (use_extra_bufts = false: no weight
                       repacking, no AMX)   2. (a model with n_gpu_layers != 0) no GPU offload
    prefix:<model>  prefix_states     1. saved prompt states not restored, their files quarantined
    engine:<name>   engine_lookup, engine_read, engine_deserialize, warm-up of an engine
                                      1. the engine left out: its routes answer 503 naming why
    any other phase (config, imports, page_in, ...): no fallback

Only native evidence counts (edge.fleet.crashes: a native fault's signal, a lost context, no exit
record); an outside kill, an OOM kill or the watchdog is recorded as what it was and counts not.
When the last two crashes counted since the service was last healthy are the same ladder under
the same key (the model's file, the llama.cpp build, the device; an engine's entry and the
device), the next start takes the ladder's next step, says so loudly (start report, `edge
status`, the READY status line, `edge_safe_mode_info`, the EdgeSafeMode alert) and keeps it for as
long as the key holds; one more crash of that phase with the step in force climbs again (the two
before it showed the fault, the step did not remove it). When there is no next step, safe mode
is exhausted (SafeModeExhausted): the start gives up (edge.fleet.giveup), once, with one line
naming the phase and the signal. A start that serves for
[recovery] healthy_after_s clears the count (the steps taken stay: the fault would come back);
`edge safe-mode clear` or a new key (another llama.cpp, model or device) ends safe mode.
State: `<state_dir>/safe-mode.json`, written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import Config, ModelConfig, cache_dir
from edge.errors import SafeModeExhausted
from edge.fleet.crashes import NATIVE_CAUSES, cause_of
from edge.fleet.history import read_json
from edge.fsutil import atomic_write, private_dir
from edge.timing import Phases

__all__ = ["SAFE_MODE_FILE", "Fallback", "SafeMode", "ladder_of", "safe_mode_keys"]

log = logging.getLogger("edge")

SAFE_MODE_FILE = "safe-mode.json"
FORMAT = 1
STEPS = {"llama": ("llama.cpp without extra buffer types (use_extra_bufts = false)",
                   "no GPU offload (n_gpu_layers = 0)"),
         "prefix": ("saved prompt states not restored, their files quarantined",),
         "engine": ("the engine left out (its routes answer 503)",)}
_LLAMA = {Phases.MODEL_LOAD, Phases.MLOCK_VERIFY}
_ENGINE = {Phases.ENGINE_LOOKUP, Phases.ENGINE_READ, Phases.ENGINE_DESERIALIZE}


def ladder_of(phase: str, model: str | None = None, engine: str | None = None) -> str | None:
    """The ladder a crash in `phase` (on `model` or `engine`) climbs; None: the phase has none."""
    if phase == Phases.SERVING:
        return "llama:*"
    if model and (phase in _LLAMA or phase == Phases.WARMUP):
        return f"llama:{model}"
    if model and phase == Phases.PREFIX_STATES:
        return f"prefix:{model}"
    if engine and (phase in _ENGINE or phase == Phases.WARMUP):
        return f"engine:{engine}"
    return None


def safe_mode_keys(cfg: Config) -> dict[str, str]:
    """Every ladder's key: what must stay the same for the same crash to be the same fault."""
    runtime = _runtime_identity()
    keys: dict[str, str] = {}
    for m in cfg.models:
        keys[f"llama:{m.name}"] = keys[f"prefix:{m.name}"] = _digest({"model": _file_identity(m), **runtime})
    keys["llama:*"] = _digest(sorted(v for k, v in keys.items() if k.startswith("llama:")))
    for e in cfg.engines:
        keys[f"engine:{e.name}"] = _digest({"engine": [e.recipe, e.onnx_sha256, e.precision, e.backend],
                                            **runtime})
    return keys


def _file_identity(m: ModelConfig) -> Any:
    if m.sha256:
        return m.sha256.lower()
    if m.path.startswith("builtin:"):
        return m.path
    try:
        st = Path(m.path).stat()
        return [str(Path(m.path).resolve()), st.st_size, st.st_mtime_ns]
    except OSError:
        return m.path


def _runtime_identity() -> dict[str, Any]:
    """The llama.cpp build (its libraries' names, sizes and times, found without importing it)
    and the device (CPU model, Jetson module): read from files, cheap enough for every start."""
    from edge.model.gpu import llama_lib_dir

    lib_dir = llama_lib_dir()
    libs = []
    if lib_dir is not None:
        for p in sorted(lib_dir.glob("lib*.so*")):
            try:
                st = p.stat()
                libs.append([p.name, st.st_size, st.st_mtime_ns])
            except OSError:
                continue
    return {"llama_libs": libs, "machine": os.uname().machine, "cpu": _first_line("/proc/cpuinfo", "model name"),
            "module": _read("/proc/device-tree/compatible")}


def _first_line(path: str, prefix: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), "")
    except OSError:
        return ""


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _digest(value: Any) -> str:
    import hashlib  # here: imported before the config

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Fallback:
    """One step taken: which ladder, how far up, and the crashes that made it."""

    ladder: str
    level: int
    key: str
    phase: str
    signal: str
    since: str
    healthy_at: float = 0.0  # the service served healthy_after_s with this step in force
    retried: bool = False  # the full path was tried again once after that, and crashed

    @property
    def what(self) -> str:
        return STEPS[self.ladder.split(":", 1)[0]][self.level - 1]

    @property
    def reason(self) -> str:
        return f"{self.phase} crashed twice in a row ({_signal(self.signal)}) under this key"

    def as_dict(self) -> dict[str, Any]:
        target = self.ladder.split(":", 1)[1]
        return {"ladder": self.ladder, "level": self.level, "target": target, "phase": self.phase,
                "signal": self.signal, "since": self.since, "fallback": self.what, "reason": self.reason}


@dataclass
class SafeMode:
    """The safe-mode state of one state dir."""

    state_dir: Path
    fallbacks: dict[str, Fallback] = field(default_factory=dict)
    counted_from: float = 0.0  # crashes that started before this are counted no more (healthy, or climbed)
    trials: dict[str, Fallback] = field(default_factory=dict)  # steps set aside while the full path is tried

    @property
    def path(self) -> Path:
        return self.state_dir / SAFE_MODE_FILE

    @classmethod
    def load(cls, state_dir: Path) -> "SafeMode":
        data = read_json(state_dir / SAFE_MODE_FILE)
        mode = cls(state_dir)
        if data is None or data.get("format") != FORMAT:
            return mode
        try:
            mode.fallbacks = {k: Fallback(**v) for k, v in (data.get("fallbacks") or {}).items()}
            mode.trials = {k: Fallback(**v) for k, v in (data.get("trials") or {}).items()}
            mode.counted_from = float(data.get("counted_from") or 0.0)
        except (TypeError, ValueError):
            log.warning("%s is damaged: safe mode starts afresh", mode.path)
            mode.fallbacks, mode.trials, mode.counted_from = {}, {}, 0.0
        return mode

    def save(self) -> None:
        data = {"format": FORMAT, "counted_from": self.counted_from,
                "fallbacks": {k: dataclasses.asdict(f) for k, f in self.fallbacks.items()},
                "trials": {k: dataclasses.asdict(f) for k, f in self.trials.items()}}
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        if os.geteuid() == 0:  # `edge safe-mode clear` as root: the file stays the service's own
            st = self.state_dir.stat()
            os.chown(self.path, st.st_uid, st.st_gid)

    def level(self, ladder: str) -> int:
        f = self.fallbacks.get(ladder)
        return f.level if f else 0

    def decide(self, crashes: list[dict[str, Any]], keys: dict[str, str], top: dict[str, int]) -> list[Fallback]:
        """Drop the steps whose key changed; climb one step when the last two crashes counted are
        the same ladder under its current key, or when one crash is the phase of a step already in
        force (the step did not remove the fault); SafeModeExhausted when it has no step left.
        Only native evidence is counted (edge.fleet.crashes.NATIVE_CAUSES: not an outside kill,
        an OOM kill or the watchdog). `top`: each ladder's last level (llama: 2 with GPU offload,
        else 1). The steps newly taken."""
        for ladder in [k for k, f in self.fallbacks.items() if keys.get(k) != f.key]:
            log.warning("safe mode: %s ends: its key changed (another llama.cpp, model or device)", ladder)
            del self.fallbacks[ladder]
        counted = [c for c in crashes if (c.get("started_unix") or 0) > self.counted_from
                   and _cause(c) in NATIVE_CAUSES]
        if not counted:
            self._try_full_path()
            return []
        b = counted[-1]
        ladder = _ladder(b)
        if self._trial_failed(b, ladder):
            return [self.fallbacks[ladder or ""]]
        if not (self._in_step(b, ladder, keys) or len(counted) >= 2 and _same(counted[-2], b, ladder, keys)):
            return []
        self.counted_from = float(b.get("started_unix") or time.time())
        level = self.level(ladder) + 1 if ladder else 1
        if ladder is None or level > top.get(ladder, len(STEPS[ladder.split(":")[0]])):
            self.save()
            raise SafeModeExhausted(_exhausted(b, ladder, self.fallbacks.get(ladder or "")))
        step = Fallback(ladder, level, keys[ladder], str(b.get("phase")), str(b.get("signal") or "unknown"),
                        str(b.get("at") or ""))
        self.fallbacks[ladder] = step
        self.save()
        return [step]

    def _try_full_path(self) -> None:
        """A step stays no longer than its evidence: one that served healthy_after_s is set aside
        for this (quiet) start, once; the start that serves healthy with the full path ends it."""
        for ladder, f in list(self.fallbacks.items()):
            if f.healthy_at and not f.retried:
                log.warning("safe mode: %s: trying the full path again, once (%s served healthy with the "
                            "step in force; a crash of %s puts the step back)", ladder, f.what, f.phase)
                self.trials[ladder] = self.fallbacks.pop(ladder)
        if self.trials:
            self.save()

    def _trial_failed(self, crash: dict[str, Any], ladder: str | None) -> bool:
        """The full path, tried again, crashed in the step's phase: the step is back, for good."""
        trial = self.trials.get(ladder or "")
        if trial is None or trial.phase != crash.get("phase") or (crash.get("keys") or {}).get(ladder) != trial.key:
            return False
        del self.trials[ladder or ""]
        self.fallbacks[trial.ladder] = dataclasses.replace(trial, retried=True, healthy_at=0.0)
        self.counted_from = float(crash.get("started_unix") or time.time())
        self.save()
        log.error("SAFE MODE: %s: the full path crashed again in %s: %s is back, for good", ladder, trial.phase,
                  trial.what)
        return True

    def _in_step(self, crash: dict[str, Any], ladder: str | None, keys: dict[str, str]) -> bool:
        """`crash` is the phase of the step in force on its ladder, under the same key."""
        taken = self.fallbacks.get(ladder or "")
        return (taken is not None and taken.phase == crash.get("phase")
                and (crash.get("keys") or {}).get(ladder) == keys.get(ladder or "") == taken.key)

    def clear(self) -> None:
        """`edge safe-mode clear`: every step ended, the crashes so far counted no more."""
        self.fallbacks, self.trials = {}, {}
        self.counted_from = time.time()
        self.save()

    def healthy(self) -> None:
        """Served for a while: the crashes so far are counted no more; each step in force has shown
        it holds (the next start may try the full path once); the full path tried held (its step
        ends). Read again first: `edge safe-mode clear` may have run meanwhile."""
        on_disk = SafeMode.load(self.state_dir)
        self.fallbacks, self.trials = on_disk.fallbacks, on_disk.trials
        self.counted_from = time.time()
        for ladder, f in self.fallbacks.items():
            self.fallbacks[ladder] = f if f.retried else dataclasses.replace(f, healthy_at=self.counted_from)
        for ladder in self.trials:
            log.warning("safe mode: %s ends: the full path served healthy again", ladder)
        self.trials = {}
        self.save()

    def describe(self) -> list[dict[str, Any]]:
        return [f.as_dict() for f in self.fallbacks.values()]

    def apply(self, cfg: Config) -> tuple[Config, dict[str, str]]:
        """`cfg` with every step in force: models without extra buffer types or offload, or
        without their prefix states; engines left out (name -> why, for their 503s)."""
        models = []
        for m in cfg.models:
            level = max(self.level(f"llama:{m.name}"), self.level("llama:*"))
            if level >= 1:
                m = dataclasses.replace(m, use_extra_bufts=False)
            if level >= 2:
                m = dataclasses.replace(m, n_gpu_layers=0)
            if self.level(f"prefix:{m.name}"):
                m = dataclasses.replace(m, prefixes=[], learn_prefixes=0)
            models.append(m)
        left_out = {e.name: f"left out by safe mode: {self.fallbacks[f'engine:{e.name}'].reason}"
                    for e in cfg.engines if self.level(f"engine:{e.name}")}
        engines = [e for e in cfg.engines if e.name not in left_out]
        return dataclasses.replace(cfg, models=models, engines=engines), left_out

    def quarantine(self, cfg: Config, steps: list[Fallback]) -> None:
        """A prefix step just taken: the model's saved states moved aside (never read again by
        edge; kept for a person to look at) under <cache_dir>/prefix/.quarantine/."""
        from edge.model.prefixstore import folder_for

        for step in steps:
            kind, _, model = step.ladder.partition(":")
            folder = folder_for(cache_dir(cfg), model)
            if kind != "prefix" or not folder.is_dir():
                continue
            aside = folder.parent / ".quarantine" / f"{model}-{time.strftime('%Y%m%dT%H%M%S')}"
            private_dir(aside.parent)
            folder.rename(aside)
            log.error("SAFE MODE: the prefix states of %s were moved to %s", model, aside)


def _signal(name: Any) -> str:
    return f"SIG{name}" if name and name not in ("unknown", "none") else "signal unknown" if name != "none" else "no signal"


def _cause(crash: dict[str, Any]) -> str:
    return str(crash.get("cause") or cause_of(crash.get("signal"), str(crash.get("service_result") or ""),
                                              crash.get("exit_status")))


def _same(a: dict[str, Any], b: dict[str, Any], ladder: str | None, keys: dict[str, str]) -> bool:
    """Two crashes of one phase on one ladder, both under the ladder's current key."""
    return (a.get("phase") == b.get("phase") and _ladder(a) == ladder
            and (ladder is None or (a.get("keys") or {}).get(ladder) == keys.get(ladder) == (b.get("keys") or {}).get(ladder)))


def _ladder(crash: dict[str, Any]) -> str | None:
    return ladder_of(str(crash.get("phase")), crash.get("model"), crash.get("engine"))


def _exhausted(crash: dict[str, Any], ladder: str | None, taken: Fallback | None) -> str:
    on = f" ({crash.get('model') or crash.get('engine')})" if crash.get("model") or crash.get("engine") else ""
    how = (f"crashed again ({_signal(crash.get('signal'))}) with its last fallback in force ({taken.what})"
           if taken else f"crashed twice in a row ({_signal(crash.get('signal'))})"
           + (" and it has no safe fallback" if ladder is None else ""))
    return (f"safe mode exhausted: phase {crash.get('phase')}{on} {how}; not trying the native path again "
            "until something changes. Fix the cause (edge status shows the crashes), then `edge safe-mode clear`")


def top_levels(cfg: Config) -> dict[str, int]:
    """The last step of each llama ladder: no offload exists only for a model that offloads."""
    tops = {f"llama:{m.name}": 2 if m.n_gpu_layers != 0 else 1 for m in cfg.models}
    return {**tops, "llama:*": max(tops.values(), default=1)}
