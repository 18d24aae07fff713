"""docs/config.md's reference, from the typed config (edge.config's dataclasses): every table and
key, its type, default and bounds, and the comments written beside it in the code."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import typing
from typing import Any

from edge import config as config_mod

from docgen.markdown import cell as _cell

_TOML_TYPES = {str: "string", int: "integer", float: "float", bool: "boolean", Any: "any"}

def _comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: the block of comment lines just above it (no
    blank line between) and the comment on its own line, joined."""
    source = inspect.getsource(cls)
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    block: list[str] = []
    for no, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(by_line.get(no, ""))
            continue
        m = re.match(r"\s+(\w+)\s*:", line)
        if m and m.group(1) in names:
            own = by_line.get(no)
            out[m.group(1)] = " ".join(block + ([own] if own else []))
        block = []
    return out

def _type(tp: Any, meta: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        kinds = [_type(a, meta) for a in args if a is not type(None)]
        choices = meta.get("choices") if meta else None
        text = " or ".join(dict.fromkeys(kinds))
        if choices and str in args:
            text = " or ".join(dict.fromkeys(kinds[:-1] + [_toml(c) for c in choices if isinstance(c, str)]))
        return text + (" (optional)" if type(None) in args else "")
    if origin is list:
        inner = args[0]
        if dataclasses.is_dataclass(inner) or typing.get_origin(inner) is dict:
            return "array of tables"
        return f"array of {_type(inner, None)}s"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "table"
    return _TOML_TYPES.get(tp, getattr(tp, "__name__", str(tp)))

def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)

def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else f"`{_toml(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        made = f.default_factory()  # type: ignore[misc]
        return f"`{_toml(made)}`" if isinstance(made, list) else "(a table of its defaults)"
    return "**required**"

def _bounds(f: dataclasses.Field) -> str:
    lo, hi = f.metadata.get("range", (None, None))
    choices = f.metadata.get("choices")
    if choices:
        return "one of " + ", ".join(f"`{_toml(c)}`" for c in choices)
    if lo is None and hi is None:
        return ""
    return f"{'' if lo is None else lo} … {'' if hi is None else hi}".strip()

def _inner(tp: Any) -> type | None:
    """The dataclass a field's value is made of (a table, an array of tables), if any."""
    for arg in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
        for sub in typing.get_args(arg):
            if dataclasses.is_dataclass(sub):
                return sub  # type: ignore[return-value]
    return None

def _tables(cls: type, where: str, array: bool) -> list[tuple[str, type, bool]]:
    """(TOML table name, dataclass, is an array of tables) for cls and every table below it."""
    out = [(where, cls, array)] if where else []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = _inner(hints[f.name])
        if inner is not None:
            name = f"{where}.{f.name}" if where else f.name
            out += _tables(inner, name, typing.get_origin(hints[f.name]) is list
                           or any(typing.get_origin(a) is list for a in typing.get_args(hints[f.name])))
    return out

def config_reference() -> str:
    """Every table of the config and every key of it, in the order of the dataclasses."""
    parts = []
    for name, cls, array in _tables(config_mod.Config, "", False):
        hints, notes = typing.get_type_hints(cls), _comments(cls)
        header = f"[[{name}]]" if array else f"[{name}]"
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        rows = ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            if f.name == "source" or _inner(hints[f.name]) is not None and _type(hints[f.name], f.metadata) == "array of tables":
                continue  # a table of its own, below
            rows.append(f"| `{f.name}` | {_type(hints[f.name], f.metadata)} | {_default(f)} | {_bounds(f)} | "
                        f"{_cell(notes.get(f.name, ''))} |")
        nested = [f"`{n}`" for n, _, _ in _tables(cls, name, array)[1:] if n.count(".") == name.count(".") + 1]
        parts.append("\n".join([f"### `{header}`", "", *([_cell(doc), ""] if doc else []), *rows,
                                *(["", "Tables inside it: " + ", ".join(nested) + "."] if nested else [])]))
    return "\n\n".join(parts)

def undocumented_keys() -> list[str]:
    """Keys with no comment in the code: the reference would leave their meaning empty."""
    return [f"{name}.{f.name}" for name, cls, _ in _tables(config_mod.Config, "", False)
            for f in dataclasses.fields(cls)
            if not _comments(cls).get(f.name) and _inner(typing.get_type_hints(cls)[f.name]) is None]

