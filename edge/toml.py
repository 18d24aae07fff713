"""TOML on every supported Python, parsed and typed: `tomllib` (3.11+) or its backport `tomli`
(3.10, as JetPack 6 ships), the one place edge imports a TOML parser; and `build_dataclass`, a
frozen dataclass from a parsed table, every error naming the file and the dotted field (the
config, edge.config, and the engine recipes, edge.engines.recipe, are both built by it)."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from typing import Any

from edge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib as _toml  # novermin (3.11+ only, behind the version check)
else:  # pragma: no cover - exercised by the Python 3.10 CI check
    import tomli as _toml

__all__ = ["TOMLDecodeError", "build_dataclass", "loads", "value_range"]

TOMLDecodeError = _toml.TOMLDecodeError
loads = _toml.loads


def value_range(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    """A field's metadata bounding its value (None: open), checked by build_dataclass."""
    return {"range": (lo, hi)}


def build_dataclass(cls: type, raw: Any, source: str, where: str) -> Any:
    """Build a (frozen) dataclass from a TOML table; every error names source and field. A
    field's metadata may bound its value: "range" (lo, hi; None for open) and "choices"."""
    if not isinstance(raw, dict):
        raise ConfigError(source, where or "<top>", f"expected a table, found {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(source, key, f"unknown key; expected one of {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(source, key, "missing: this field is required")
            continue
        try:
            values[name] = _coerce(hints[name], raw[name], source, key)
        except ConfigError:
            if not f.metadata.get("choices"):
                raise  # else the choices say best what was expected (`"auto"`, true or false)
            raise ConfigError(source, key, f"expected one of {list(f.metadata['choices'])}, "
                              f"found {_kind(raw[name])} {raw[name]!r}") from None
        lo, hi = f.metadata.get("range", (None, None))
        val = values[name]
        if (lo is not None and not val >= lo) or (hi is not None and not val <= hi):
            raise ConfigError(source, key, f"expected a value in [{lo}, {hi}], found {val!r}")
        choices = f.metadata.get("choices")
        if choices and val not in choices:
            raise ConfigError(source, key, f"expected one of {list(choices)}, found {val!r}")
    return cls(**values)


def _coerce(tp: Any, val: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        for arg in args[:-1]:  # `bool | str`: the first type the value is
            try:
                return _coerce(arg, val, source, key)
            except ConfigError:
                pass
        return _coerce(args[-1], val, source, key)
    if origin is dict:  # free-form tables (a tool's JSON schema): TOML already typed their values
        if not isinstance(val, dict):
            raise ConfigError(source, key, f"expected a table, found {_kind(val)}")
        return val
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(val, list):
            raise ConfigError(source, key, f"expected an array, found {_kind(val)}")
        return [_coerce(item, v, source, f"{key}[{i}]") for i, v in enumerate(val)]
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, val, source, key)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](val)
    if not ok:
        raise ConfigError(source, key, f"expected {_TYPE_WORDS[tp]}, found {_kind(val)} {val!r}")
    if tp is float and not math.isfinite(val):  # TOML has nan and inf; no field means either
        raise ConfigError(source, key, f"expected a finite number, found {val!r}")
    return float(val) if tp is float else val


_TYPE_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _kind(val: Any) -> str:
    return {dict: "a table", list: "an array", bool: "a boolean", int: "an integer",
            float: "a float", str: "a string"}.get(type(val), type(val).__name__)
