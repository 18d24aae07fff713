"""The factory state: the config the service ran before OTA took over, i.e. the device config
(`/etc/edge/edge.toml`, or the installer's --config) as it was when OTA first ran on the device.
It is recorded once, at the first install (or the first `recover`), as <ota>/factory/edge.toml,
and `current` points at it while no version is installed, so the unit's
`--config <ota>/current/edge.toml` always names a config: after Mender rolls back a first
install, the service goes back to it.

The copy keeps the original's text; relative paths in it (models, recipes, engine stores) are
made absolute, since they were relative to the original's directory, and the copy is accepted
only if it resolves every one of them to the same file as the original does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from edge.ota.fsops import Fs
from edge.ota.links import FACTORY, HOME

__all__ = ["record_factory", "FACTORY"]

_KEYS = {"models": ("path",), "engines": ("recipe", "store")}


def _resolved(cfg: Any) -> list[str | None]:
    return [m.path for m in cfg.models] + [x for e in cfg.engines for x in (e.recipe, e.store)]


def _absolute(text: str, base: Path) -> str:
    """The config text with its relative file paths written as absolute ones."""
    from edge import toml
    from edge.config import BUILTIN_PREFIX

    raw = toml.loads(text)
    for table, keys in _KEYS.items():
        for item in raw.get(table) or []:
            for key in keys:
                value = item.get(key) if isinstance(item, dict) else None
                if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith(BUILTIN_PREFIX):
                    continue
                literal = rf"(?m)^(\s*{key}\s*=\s*)([\"']){re.escape(value)}\2"
                text = re.sub(literal, lambda m: m.group(1) + json.dumps(str((base / value).resolve())), text)
    return text


def _copy(config: Path, into: Path, fs: Fs) -> str | None:
    """Write the factory copy of `config` into `into`; None, or why it cannot be recorded."""
    from edge.config import parse_config
    from edge.errors import EdgeError

    try:
        text = config.read_text(encoding="utf-8")
        original = parse_config(text, source=str(config), base_dir=config.parent)
        copy = _absolute(text, config.parent)
        again = parse_config(copy, source=str(into / "edge.toml"), base_dir=into)
    except (OSError, UnicodeDecodeError, ValueError, EdgeError) as exc:  # TOMLDecodeError is a ValueError
        return f"{config} cannot be recorded: {exc}"
    if _resolved(again) != _resolved(original):
        return (f"{config} cannot be recorded: its relative paths could not be made absolute (a path "
                "in an inline table?); use absolute paths there")
    fs.write_file(into / "edge.toml", copy.encode())
    return None


def record_factory(root: Path, fs: Fs, config: Path | None) -> dict[str, Any]:
    """The state's `factory` entry: {config, sha256, recorded} once <root>/factory exists, or
    {unavailable: why}."""
    if config is None:
        return {"unavailable": "no device config file (the installer ran on built-in defaults)"}
    final = root / FACTORY
    if final.is_dir():  # recorded at the first install; the state that said so was lost since
        return {"config": str(config.resolve()), "sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
                "recorded": "at an earlier first install (kept)"}
    staging = root / f".{FACTORY}-{os.getpid()}"
    fs.mkdir(staging)
    try:
        why = _copy(config, staging, fs)
        if why is not None:
            return {"unavailable": why}
        fs.symlink(FACTORY, staging / HOME)
        fs.fsync_dir(staging)
        fs.replace(staging, final)
        fs.fsync_dir(root)
    finally:
        if staging.exists():
            fs.rmtree(staging)
    return {"config": str(config.resolve()), "sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
