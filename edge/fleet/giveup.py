"""The give-up that sticks: once safe mode is exhausted (edge.lifecycle.safemode), the state dir
says so, with the crashes that led there, and every later start reads it before llama.cpp is
imported. Socket activation starts the service again for every new client whatever its last
exit code, so an exit alone would be a crash loop with extra steps; a recorded give-up is seen by
each of those starts, which then only answers (edge.lifecycle.unavailable) instead of crashing.

    <state_dir>/given-up.json
    {"format": 1, "at": 1767000000.0, "since": "2026-12-06T20:31:02+0000",
     "reason": "safe mode exhausted: phase warmup (tiny) crashed again (SIGSEGV) ...",
     "phase": "warmup", "signal": "SEGV", "target": "tiny",
     "crashes": [{"at": ..., "pid": ..., "phase": ..., "signal": ..., "cause": ..., "record": ...}],
     "fingerprint": {"config": "<sha256 of the config file>", "keys": "<digest of safe mode's keys>",
                     "edge": "<edge version>"},
     "retry_s": 600.0, "round": 1, "retrying": false}

It ends when something changed: `edge safe-mode clear` (the file removed), another config (its
bytes), another model file, llama.cpp build or device (safe mode's keys), another edge version;
or after `retry_s` (`[server] give_up_retry_s`, 600 s), when one start tries the native path
again with safe mode's last steps in force (`retrying`): when it crashes again the give-up is
back with twice the interval (at most 16 times `give_up_retry_s`), when it serves for
`healthy_after_s` the file is removed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge.fleet.history import read_json
from edge.fsutil import atomic_write

__all__ = ["GIVE_UP_FILE", "MAX_BACKOFF_FACTOR", "GiveUp", "fingerprint"]

GIVE_UP_FILE = "given-up.json"
FORMAT = 1
MAX_BACKOFF_FACTOR = 16  # the retry interval doubles per give-up in a row, up to this many times the base
_CHANGES = (("config", "the config file changed"), ("keys", "the model file, llama.cpp build or device changed"),
            ("edge", "another edge version is installed"))


def fingerprint(config_source: str, keys: dict[str, str], edge_version: str) -> dict[str, str]:
    """What must stay the same for the give-up to hold: the config file's bytes, safe mode's keys,
    edge's version."""
    import hashlib  # here: this module is imported before the config

    try:
        config = hashlib.sha256(Path(config_source).read_bytes()).hexdigest()
    except OSError:
        config = config_source  # the built-in default config: its name
    digest = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]
    return {"config": config, "keys": digest, "edge": edge_version}


@dataclass
class GiveUp:
    """One give-up: why, since when, what ends it."""

    at: float
    reason: str
    phase: str = ""
    signal: str = ""
    target: str = ""
    crashes: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: dict[str, str] = field(default_factory=dict)
    retry_s: float = 600.0
    round: int = 1
    retrying: bool = False

    @classmethod
    def load(cls, state_dir: Path) -> "GiveUp | None":
        data = read_json(state_dir / GIVE_UP_FILE)
        if data is None or data.get("format") != FORMAT:
            return None
        try:
            return cls(**{k: v for k, v in data.items() if k not in ("format", "since", "retry_at")})
        except TypeError:
            return None

    @classmethod
    def begin(cls, reason: str, crashes: list[dict[str, Any]], fp: dict[str, str], base_retry_s: float,
              before: "GiveUp | None") -> "GiveUp":
        """A give-up now, after `crashes` (oldest first); its interval doubles when the one `before`
        was retrying under the same fingerprint (nothing changed, the retry crashed too)."""
        again = before is not None and before.retrying and before.fingerprint == fp
        n = before.round + 1 if again and before is not None else 1
        last = crashes[-1] if crashes else {}
        rows = [{k: c.get(k) for k in ("at", "pid", "phase", "model", "engine", "signal", "cause", "record")}
                for c in crashes[-6:]]
        return cls(time.time(), reason, str(last.get("phase") or ""), str(last.get("signal") or ""),
                   str(last.get("model") or last.get("engine") or ""), rows, fp,
                   base_retry_s * min(2 ** (n - 1), MAX_BACKOFF_FACTOR), n)

    def save(self, state_dir: Path) -> None:
        path = state_dir / GIVE_UP_FILE
        atomic_write(path, json.dumps({"format": FORMAT, **self.as_dict()}, indent=1, sort_keys=True) + "\n")
        if os.geteuid() == 0:  # written by `edge safe-mode` as root: the file stays the service's own
            st = state_dir.stat()
            os.chown(path, st.st_uid, st.st_gid)

    @staticmethod
    def remove(state_dir: Path) -> bool:
        try:
            (state_dir / GIVE_UP_FILE).unlink()
            return True
        except FileNotFoundError:
            return False

    @property
    def retry_at(self) -> float:
        return self.at + self.retry_s

    def retry_after_s(self, now: float | None = None) -> int:
        """Whole seconds until the retry (at least 1): a client's Retry-After."""
        return max(1, int(self.retry_at - (time.time() if now is None else now) + 0.999))

    def ended_by(self, fp: dict[str, str], now: float | None = None) -> str | None:
        """Why the give-up no longer holds (something changed, or its interval passed); None
        while it holds. A give-up that is being retried holds no more."""
        for name, what in _CHANGES:
            if fp.get(name) != self.fingerprint.get(name):
                return what
        if self.retrying:
            return "it is being retried"
        if (time.time() if now is None else now) >= self.retry_at:
            return f"its retry interval ({self.retry_s:.0f} s) passed"
        return None

    def changed(self, fp: dict[str, str]) -> bool:
        return any(fp.get(name) != self.fingerprint.get(name) for name, _ in _CHANGES)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.at)),
                "retry_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.retry_at))}
