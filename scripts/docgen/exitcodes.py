"""docs/faults.md's exit-code table, from edge.errors (EXIT_CODES, the classes and the tree drawn
in its docstring) and the shipped unit's RestartPreventExitStatus=."""

from __future__ import annotations

import inspect
import re

from edge import errors

from docgen.markdown import cell as _cell
from docgen.paths import ROOT

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


