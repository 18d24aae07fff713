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

When the last two crashes since the service was last healthy are the same ladder under the same
key (the model's file, the llama.cpp build, the device; an engine's entry and the device), the
next start takes the ladder's next step, says so loudly (start report, `edge status`, the
READY status line, `edge_safe_mode_info`, the EdgeSafeMode alert) and keeps it for as long as
the key holds. When there is no next step, the start exits 76 (SafeModeExhausted), which the
unit does not restart, with one line naming the phase and the signal. A start that serves for
[recovery] healthy_after_s clears the count (the steps taken stay: the fault would come back);
`edge safe-mode clear` or a new key (another llama.cpp, model or device) ends safe mode.
State: `<state_dir>/safe-mode.json`, written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import Config, ModelConfig, cache_dir
from edge.errors import SafeModeExhausted
from edge.fleet.history import read_json
from edge.fsutil import atomic_write
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
    return {"llama_libs": libs, "machine": platform.machine(), "cpu": _first_line("/proc/cpuinfo", "model name"),
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
            mode.counted_from = float(data.get("counted_from") or 0.0)
        except (TypeError, ValueError):
            log.warning("%s is damaged: safe mode starts afresh", mode.path)
            mode.fallbacks, mode.counted_from = {}, 0.0
        return mode

    def save(self) -> None:
        data = {"format": FORMAT, "counted_from": self.counted_from,
                "fallbacks": {k: dataclasses.asdict(f) for k, f in self.fallbacks.items()}}
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        if os.geteuid() == 0:  # `edge safe-mode clear` as root: the file stays the service's own
            st = self.state_dir.stat()
            os.chown(self.path, st.st_uid, st.st_gid)

    def level(self, ladder: str) -> int:
        f = self.fallbacks.get(ladder)
        return f.level if f else 0

    def decide(self, crashes: list[dict[str, Any]], keys: dict[str, str], top: dict[str, int]) -> list[Fallback]:
        """Drop the steps whose key changed; climb one step when the last two crashes counted are
        the same ladder under its current key; SafeModeExhausted when it has no step left. `top`:
        each ladder's last level (llama: 2 with GPU offload, else 1). The steps newly taken."""
        for ladder in [k for k, f in self.fallbacks.items() if keys.get(k) != f.key]:
            log.warning("safe mode: %s ends: its key changed (another llama.cpp, model or device)", ladder)
            del self.fallbacks[ladder]
        counted = [c for c in crashes if (c.get("started_unix") or 0) > self.counted_from]
        if len(counted) < 2:
            return []
        a, b = counted[-2:]
        ladder_a, ladder_b = _ladder(a), _ladder(b)
        same = (a.get("phase") == b.get("phase") and ladder_a == ladder_b
                and (ladder_a is None or (a.get("keys") or {}).get(ladder_a) == keys.get(ladder_a)
                     == (b.get("keys") or {}).get(ladder_a)))
        if not same:
            return []
        self.counted_from = float(b.get("started_unix") or time.time())
        level = self.level(ladder_a) + 1 if ladder_a else 1
        if ladder_a is None or level > top.get(ladder_a, len(STEPS[ladder_a.split(":")[0]])):
            self.save()
            raise SafeModeExhausted(_exhausted(b, ladder_a, self.fallbacks.get(ladder_a or "")))
        step = Fallback(ladder_a, level, keys[ladder_a], str(b.get("phase")), str(b.get("signal") or "unknown"),
                        str(b.get("at") or ""))
        self.fallbacks[ladder_a] = step
        self.save()
        return [step]

    def clear(self) -> None:
        """`edge safe-mode clear`: every step ended, the crashes so far counted no more."""
        self.fallbacks = {}
        self.counted_from = time.time()
        self.save()

    def healthy(self) -> None:
        """Served for a while: the crashes so far are counted no more."""
        self.counted_from = time.time()
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
            aside.parent.mkdir(parents=True, exist_ok=True)
            folder.rename(aside)
            log.error("SAFE MODE: the prefix states of %s were moved to %s", model, aside)


def _signal(name: Any) -> str:
    return f"SIG{name}" if name and name not in ("unknown", "none") else "signal unknown" if name != "none" else "no signal"


def _ladder(crash: dict[str, Any]) -> str | None:
    return ladder_of(str(crash.get("phase")), crash.get("model"), crash.get("engine"))


def _exhausted(crash: dict[str, Any], ladder: str | None, taken: Fallback | None) -> str:
    on = f" ({crash.get('model') or crash.get('engine')})" if crash.get("model") or crash.get("engine") else ""
    after = f", with its last fallback ({taken.what})" if taken else (" and it has no safe fallback"
                                                                          if ladder is None else "")
    return (f"safe mode exhausted: phase {crash.get('phase')}{on} crashed twice in a row "
            f"({_signal(crash.get('signal'))}){after}; not starting again. Fix the cause (edge status "
            "shows the crashes), then `edge safe-mode clear`")


def top_levels(cfg: Config) -> dict[str, int]:
    """The last step of each llama ladder: no offload exists only for a model that offloads."""
    tops = {f"llama:{m.name}": 2 if m.n_gpu_layers != 0 else 1 for m in cfg.models}
    return {**tops, "llama:*": max(tops.values(), default=1)}
