"""The generated parts of docs/: the config reference (docs/config.md) from the typed config
(edge.config's dataclasses: every key, its type, default, bounds, and the comments written beside
it in the code) and the exit-code table (docs/faults.md) from edge.errors (EXIT_CODES, each
class's docstring) and the shipped unit's RestartPreventExitStatus=.

Each part sits in its page between `<!-- BEGIN GENERATED: NAME -->` and `<!-- END GENERATED: NAME -->`;
the prose around it is written by hand. `--write` rewrites the parts in place; `--check` (and
tests/test_docs.py) fails, naming the page, where one differs from what the code gives now.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path
from typing import Any

from edge import config as config_mod
from edge import errors

ROOT = Path(__file__).resolve().parent.parent

PARTS = {"config": "docs/config.md", "exit-codes": "docs/faults.md"}
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
    if origin is dict:
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


def _cell(text: str) -> str:
    """One table cell: on one line, its pipes escaped, and `<cache_dir>` shown, not taken for HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


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


def _no_restart() -> set[int]:
    unit = (ROOT / "systemd" / "edge.service").read_text()
    (line,) = re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    return {int(c) for c in line.split()}


def _classes(base: type) -> list[type]:
    """base and every subclass of it that edge.errors defines, depth first, in definition order."""
    out = [base]
    for sub in sorted(base.__subclasses__(), key=lambda c: inspect.getsourcelines(c)[1]):
        if sub.__module__ == errors.__name__ and sub not in out:
            out += [c for c in _classes(sub) if c not in out]
    return out


def _tree() -> dict[str, str]:
    """Each class's line(s) in edge.errors' drawn tree (its docstring), without the exit code:
    the short meaning tests/test_errors.py holds to the classes."""
    out: dict[str, str] = {}
    name, column = "", 0
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^(\s*[│├└─ ]*)(\w+)(\s+)(\d+|\(HTTP [^)]*\))\s+(.*)$", line)
        if m:
            name, column = m.group(2), m.end(4)
            out[name] = m.group(5)
        elif name and line.strip() and len(line) > column and not line[:column].strip("│ "):
            out[name] += " " + line.strip().lstrip("│ ")
        else:
            name = ""
    return out


def exit_codes() -> str:
    """One row per exit code: the classes that end a command with it, what each means (its line in
    edge.errors' tree), and whether the unit restarts the service after it."""
    by_code: dict[int, list[type]] = {}
    for cls in _classes(errors.EdgeError):
        if cls is errors.RequestError:
            continue  # an HTTP answer, never an exit
        code = next(c for k, c in errors.EXIT_CODES.items() if issubclass(cls, k))
        by_code.setdefault(code, []).append(cls)
    stop, tree = _no_restart(), _tree()
    rows = ["| code | raised as: meaning | restarted by the unit? |", "| --- | --- | --- |"]
    for code in sorted(by_code):
        meaning = "; ".join(f"`{c.__name__}`: {_cell(tree[c.__name__])}" for c in by_code[code])
        restarted = "–" if code == 0 else "no (`RestartPreventExitStatus=`)" if code in stop else "yes"
        rows.append(f"| {code} | {meaning} | {restarted} |")
    return "\n".join(rows)


GENERATORS = {"config": config_reference, "exit-codes": exit_codes}


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN GENERATED: {name} [^>]*-->\n)(.*?)(<!-- END GENERATED: {name} -->)", re.S)


def stale() -> list[str]:
    """The pages whose generated part differs from what the code gives now (or lack one)."""
    out = []
    for name, page in PARTS.items():
        m = _region(name).search((ROOT / page).read_text())
        if m is None or m.group(2) != GENERATORS[name]() + "\n":
            out.append(f"{page} ({name})")
    return out


def write() -> None:
    for name, page in PARTS.items():
        path = ROOT / page
        text, n = _region(name).subn(lambda m: m.group(1) + GENERATORS[name]() + "\n" + m.group(3),
                                     path.read_text())
        if n != 1:
            raise SystemExit(f"{page}: expected one <!-- BEGIN GENERATED: {name} ... --> region, found {n}")
        path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="rewrite the generated parts of docs/")
    group.add_argument("--check", action="store_true", help="exit 1 where a generated part is stale")
    args = ap.parse_args()
    if args.write:
        write()
    elif bad := stale():
        raise SystemExit("stale, run scripts/gen_docs.py --write: " + ", ".join(bad))


if __name__ == "__main__":
    main()
