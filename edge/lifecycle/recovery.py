"""What a start does so that no way of ending goes unseen: the journal opened before the config is
read (in the state dir the service will use), the crash records of earlier processes settled and
safe mode decided (edge.lifecycle.safemode), and the end this process comes to written down.

The state dir is known before the config is parsed: the config's own `paths.state_dir` when the
file is TOML at all, else systemd's StateDirectory= ($STATE_DIRECTORY), else the state dir the
last good start of this config used (a pointer kept in the default state dir), else the default.

EDGE_TEST_FAULT (a test-only switch, never set in service): `<phase>:<SIGNAL>[:<condition>]`
raises a real signal in this process as `phase` begins (after its journal line is on disk):
`warmup:SEGV`, `model_load:BUS`, `prefix_states:ABRT`, `serving:SEGV` (right after READY=1).
With `:extra_bufts` only while llama.cpp's extra buffer types are on for the model (a fault like
ggml's AMX one, which safe mode's first step removes); with `:unless=<path>` only while that file
does not exist (a fault that a fix on disk ends, with no change to the unit).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge import __version__, toml
from edge.config import Config, default_config, find_config, state_dir
from edge.errors import SafeModeExhausted
from edge.fleet.crashes import recent_crashes, settle_all
from edge.fleet.giveup import GiveUp, fingerprint
from edge.fleet.history import CRASH, read_json, record_failed_start
from edge.fleet.journal import Journal
from edge.fsutil import atomic_write, private_dir
from edge.lifecycle.safemode import Fallback, SafeMode, safe_mode_keys, top_levels
from edge.timing import Phases, StartTimer, write_report

__all__ = ["FAULT_ENV", "FaultInjector", "GivenUp", "Recovery", "early_state_dir"]

log = logging.getLogger("edge")

FAULT_ENV = "EDGE_TEST_FAULT"
POINTERS = "config-state-dirs.json"  # in the default state dir: config file -> the state dir it named


def early_state_dir(config_path: str | None) -> Path:
    """The state dir of the config at `config_path` (the lookup order's), before it is validated."""
    default = state_dir(default_config())
    path = find_config(config_path)
    if path is None:
        return default
    try:
        raw = toml.loads(path.read_text())
    except (OSError, UnicodeDecodeError, toml.TOMLDecodeError):
        remembered = (read_json(default / POINTERS) or {}).get(str(path.resolve()))
        return Path(remembered) if isinstance(remembered, str) else default
    paths = raw.get("paths") if isinstance(raw.get("paths"), dict) else {}
    named = paths.get("state_dir")
    return Path(named) if isinstance(named, str) and named else default


def remember_state_dir(cfg: Config) -> None:
    """A good start of a config that names its own state dir: kept where `early_state_dir` looks
    when that config is not even TOML any more (written only when it changes). Configs that no
    longer exist are dropped as it is written, so the file holds what is on the device."""
    if not cfg.paths.state_dir or cfg.source in ("", "<default>"):
        return
    default = state_dir(default_config())
    pointers = read_json(default / POINTERS) or {}
    key, value = str(Path(cfg.source).resolve()), str(state_dir(cfg))
    kept = {k: v for k, v in pointers.items() if k == key or Path(k).exists()}  # configs since removed: forgotten
    if pointers.get(key) != value or len(kept) != len(pointers):
        pointers = kept
        try:
            if not default.exists():
                private_dir(default)
            atomic_write(default / POINTERS, json.dumps({**pointers, key: value}, indent=1) + "\n")
        except OSError:
            pass  # only a broken config's later failure report would land in the default dir


class GivenUp(Exception):
    """Safe mode is exhausted (now, or by a give-up on record that still holds): this start does
    not take the native path; it answers 503 instead (edge.lifecycle.unavailable)."""

    def __init__(self, give_up: GiveUp, cfg: Config) -> None:
        super().__init__(give_up.reason)
        self.give_up, self.config = give_up, cfg


class FaultInjector:
    """EDGE_TEST_FAULT as a phase observer (edge.timing.PhaseObserver)."""

    def __init__(self, spec: str) -> None:
        phase, _, rest = spec.partition(":")
        name, _, condition = rest.partition(":")
        self.phase = phase
        self.signal = signal.Signals[f"SIG{name.upper().removeprefix('SIG')}"]
        self.condition = condition

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = os.environ.get(FAULT_ENV)
        return cls(spec) if spec else None

    def observe(self, event: str, phase: str, detail: dict[str, Any]) -> None:
        if event != "enter" or phase != self.phase:
            return
        if self.condition == "extra_bufts" and detail.get("extra_bufts") is False:
            return
        if self.condition.startswith("unless=") and Path(self.condition[7:]).exists():
            return  # fixed: the file that says so is there
        log.warning("%s: raising SIG%s at phase %s", FAULT_ENV, self.signal.name.removeprefix("SIG"), phase)
        # to this thread, as a fault would be: it stops here; faulthandler writes the stacks, then
        # the signal's default action ends the process (SIGKILL: at once)
        signal.pthread_kill(threading.get_ident(), self.signal)


class Recovery:
    """One process's journal and safe mode, from before its config is read to its end."""

    def __init__(self, config_path: str | None, timer: StartTimer, kind: str = "start") -> None:
        self.state_dir = early_state_dir(config_path)
        self.kind = kind  # "handover": started by a running edge to take over (edge.lifecycle.handover.handover)
        self.journal = Journal(self.state_dir, kind=kind)
        self.fault = FaultInjector.from_env()
        self.observers: list[Callable[[str, str, dict[str, Any]], None]] = [self.journal.observe]
        if self.fault is not None:
            self.observers.append(self.fault.observe)
        timer.observers += self.observers
        self.timer = timer
        self.safe_mode: SafeMode | None = None
        self.new_steps: list[Fallback] = []
        self.keys: dict[str, str] = {}  # safe mode's keys of this start (its own crash record carries them)
        self.retrying: GiveUp | None = None  # a give-up whose interval passed: this start tries again

    def decide(self, cfg: Config) -> SafeMode:
        """The recovery phase: earlier processes' journals settled into crash records, safe mode
        brought up to date, keys journaled; GivenUp when a give-up holds, or safe mode is
        exhausted now (then recorded: edge.fleet.giveup). All before llama.cpp is imported."""
        with self.timer.phase(Phases.RECOVERY) as ph:
            if state_dir(cfg) != self.state_dir:  # e.g. the config names another dir than systemd's
                self.journal.move_to(state_dir(cfg))
                self.state_dir = state_dir(cfg)
            settled = settle_all(self.state_dir)
            keys = self.keys = safe_mode_keys(cfg)
            self.journal.keys(keys)
            mode = SafeMode.load(self.state_dir)
            self.safe_mode = mode
            fp = fingerprint(cfg.source, keys, __version__)
            before = self._given_up_before(cfg, mode, fp)
            crashes = recent_crashes(self.state_dir)
            try:
                self.new_steps = mode.decide(crashes, keys, top_levels(cfg))
            except SafeModeExhausted as exc:
                give_up = GiveUp.begin(str(exc), crashes, fp, cfg.server.give_up_retry_s, before)
                give_up.save(self.state_dir)
                log.error("%s (retrying after %.0f s)", exc, give_up.retry_s)
                raise GivenUp(give_up, cfg) from None
            ph.detail.update(settled=len(settled), safe_mode=len(mode.fallbacks))
        for step in self.new_steps:
            log.error("SAFE MODE: %s: %s; from now on: %s (`edge safe-mode clear` ends it)", step.ladder,
                      step.reason, step.what)
        return mode

    def _given_up_before(self, cfg: Config, mode: SafeMode, fp: dict[str, str]) -> GiveUp | None:
        """The give-up on record: GivenUp while it holds; when something changed, safe mode starts
        afresh (the full path); when its interval passed, this start retries with the steps in
        force. Returns the give-up being retried, if any (its interval doubles if it fails)."""
        give_up = GiveUp.load(self.state_dir)
        if give_up is None:
            return None
        why = give_up.ended_by(fp)
        if why is None:
            raise GivenUp(give_up, cfg)
        if give_up.changed(fp):
            log.warning("the give-up of %s ends: %s: trying the full path again", give_up.as_dict()["since"], why)
            mode.clear()
            GiveUp.remove(self.state_dir)
            return None
        if not give_up.retrying:
            log.warning("the give-up of %s ends: %s: trying again with safe mode's steps in force",
                        give_up.as_dict()["since"], why)
            give_up.retrying = True
            give_up.save(self.state_dir)
        self.retrying = give_up
        return give_up

    def serving(self, cfg: Config) -> None:
        """READY=1 was sent (the journal's `ready` line was written with the start report)."""
        remember_state_dir(cfg)
        if self.fault is not None:
            bufts = any(m.use_extra_bufts for m in cfg.models)
            self.fault.observe("enter", Phases.SERVING, {} if bufts else {"extra_bufts": False})

    def healthy(self) -> None:
        self.journal.healthy()
        if self.safe_mode is not None:
            self.safe_mode.healthy()
        if self.retrying is not None:  # the retry after a give-up held: the give-up is over
            GiveUp.remove(self.state_dir)
            self.retrying = None

    def given_up(self, give_up: GiveUp, cfg: Config) -> None:
        """This start answers 503 instead (edge.lifecycle.unavailable): counted as a start whose
        result is given_up, its journal in the phase of that name."""
        self.journal.enter(Phases.GIVEN_UP)
        report = self.timer.report(config=cfg.source, error=give_up.reason, exit_code=0)
        record_failed_start(self.state_dir, {**report, "result": "given_up", "given_up": give_up.as_dict()})

    def ended(self, code: int, **detail: Any) -> None:
        """Served and stopped: exit `code` (0, or a fatal reload's); `handed_over_to` a new process."""
        self.journal.end("ok" if code == 0 else "failed", code, **detail)

    def failed(self, report: dict[str, Any], result: str) -> None:
        """Ended before READY by itself: an error (failed) or SIGTERM (stopped); the report kept
        and counted, the journal closed with its name. A process started to take over that ended
        before it was ready is no failed start: the old process serves on, and its handover report
        says why (from this journal)."""
        if self.kind == "handover":
            self.journal.end(result, int(report.get("exit_code") or 0), error=str(report.get("error") or ""))
            return
        path = record_failed_start(self.state_dir, {**report, "result": result}, count=result != "stopped")
        self.journal.end(result, int(report.get("exit_code") or 0), report=path.name if path else None)

    def crashed(self, phase: str, reason: str, exit_code: int) -> None:
        """It found itself unfit to go on (e.g. a poisoned CUDA context): a crash record of its
        own, then the exit."""
        report = {**self.timer.report(), "result": "crashed", "phase": phase, "signal": "none", "cause": "fatal-error", "keys": self.keys,
                  "error": reason, "exit_code": exit_code, "reached_ready": True,
                  "ended_unix": round(time.time(), 3)}  # dated now, when it happened (not its READY)
        try:
            write_report(report, self.state_dir, kind=CRASH)
        except OSError as exc:
            log.warning("cannot record the crash in %s: %s", self.state_dir, exc)
        self.journal.end("crashed", exit_code, phase=phase, reason=reason)

