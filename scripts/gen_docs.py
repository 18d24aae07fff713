"""The generated parts of docs/, from the code itself (scripts/docgen/, one module each):

- docs/config.md: every config key, its type, default, bounds and the comment beside it in edge.config;
- docs/faults.md: every exit code, from edge.errors and the unit's RestartPreventExitStatus=;
- docs/commands.md: every `edge` command and option, from the CLI's own tree (typer/click);
- docs/fleet.md: every metric family, its type and labels, from a real `edge serve`'s `/metrics`.

Each part sits in its page between `<!-- BEGIN GENERATED: NAME -->` and `<!-- END GENERATED: NAME -->`;
the prose around it is written by hand. `--write` rewrites the parts in place; `--check` (and
tests/test_docs.py) fails, naming the page, where one differs from what the code gives now.
After a merge that changed commands, config keys, exit codes or metrics:
`.venv/bin/python scripts/gen_docs.py --write`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from docgen import commands, configref, exitcodes, metrics  # scripts/docgen: beside this file, so on sys.path

ROOT = Path(__file__).resolve().parent.parent

# name: (page, what makes it). A part may be given what another part already made (metrics:
# one scrape serves both tables), so each is called through `made` below.
PARTS: dict[str, tuple[str, Callable[[], str]]] = {
    "config": ("docs/config.md", configref.config_reference),
    "exit-codes": ("docs/faults.md", exitcodes.exit_codes),
    "commands": ("docs/commands.md", commands.reference),
    "metrics-serving": ("docs/fleet.md", lambda: metrics.tables()["serving"]),
    "metrics-identity": ("docs/fleet.md", lambda: metrics.tables()["identity"]),
}


def undocumented_keys() -> list[str]:
    return configref.undocumented_keys()


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN GENERATED: {name} [^>]*-->\n)(.*?)(<!-- END GENERATED: {name} -->)", re.S)


def stale(names: tuple[str, ...] | None = None) -> list[str]:
    """The pages whose generated part differs from what the code gives now (or lack one)."""
    out = []
    for name, (page, make) in PARTS.items():
        if names is not None and name not in names:
            continue
        m = _region(name).search((ROOT / page).read_text())
        if m is None or m.group(2) != make() + "\n":
            out.append(f"{page} ({name})")
    return out


def write() -> None:
    for name, (page, make) in PARTS.items():
        path = ROOT / page
        text, n = _region(name).subn(lambda m: m.group(1) + make() + "\n" + m.group(3), path.read_text())
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
