"""docs/commands.md's reference: every `edge` command, group and option, read from the command
tree typer builds for click (`typer.main.get_command`), rendered with click's own pieces: the
usage line (`collect_usage_pieces`), the help text, and each parameter's help record (the two
columns `--help` prints: names with metavar, and help with its default). Nothing is written by
hand, so a new command or option appears here the moment it exists, and one removed disappears."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import typer

from docgen.markdown import cell, code, prose

_DOCS_LINE = re.compile(r"^Docs: docs/([\w-]+\.md(?:#[\w-]+)?)$", re.M)


def tree() -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(words after `edge`, the command, its click context) for the root and every command below,
    depth first, in the order `--help` lists them."""
    from edge.cli import app

    root = typer.main.get_command(app)

    def walk(cmd: Any, words: tuple[str, ...], parent: Any) -> Iterator[Any]:
        # the command's own context class: typer carries click within it (typer._click)
        ctx = cmd.context_class(cmd, info_name=words[-1] if words else "edge", parent=parent)
        yield words, cmd, ctx
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            yield from walk(sub, (*words, name), ctx)

    yield from walk(root, (), None)


def _help(cmd: Any) -> tuple[str, str]:
    """The command's help without its "Docs:" line, and that line's page (linked instead)."""
    text = inspect.cleandoc(getattr(cmd, "help", None) or "")
    m = _DOCS_LINE.search(text)
    return _DOCS_LINE.sub("", text).strip(), (m.group(1) if m else "")


def _params(cmd: Any, ctx: Any) -> list[tuple[str, str]]:
    rows = []
    for p in cmd.get_params(ctx):
        record = p.get_help_record(ctx)
        if record is None or "--help" in getattr(p, "opts", ()):
            continue
        names, help_ = record
        if p.param_type_name == "argument":
            help_ = "(argument) " + help_
        rows.append((names, help_))
    return rows


def undocumented() -> list[str]:
    """Commands and options without a help text: their row in the reference would say nothing."""
    out = []
    for words, cmd, ctx in tree():
        if not _help(cmd)[0]:
            out.append(" ".join(("edge", *words)))
        for p in cmd.get_params(ctx):
            if p.param_type_name == "option" and not p.help and "--help" not in p.opts:
                out.append(f"{' '.join(('edge', *words))} {p.opts[-1]}")
    return out


def _section(words: tuple[str, ...], cmd: Any, ctx: Any) -> str:
    name = " ".join(("edge", *words))
    usage = " ".join((name, *cmd.collect_usage_pieces(ctx)))
    text, page = _help(cmd)
    out = [f"### {name}", "", code(usage), "", prose(text)]
    if page:
        out += ["", f"Docs: [{page}]({page})"]
    sub = getattr(cmd, "commands", None) or {}
    if sub:
        out += ["", "Commands: " + ", ".join(f"[{code(f'{name} {s}')}](#{'-'.join((*name.split(), s))})"
                                             for s in sub)]
    rows = _params(cmd, ctx)
    if rows:
        out += ["", "| option | meaning |", "| --- | --- |"]
        out += [f"| {code(names)} | {cell(help_)} |" for names, help_ in rows]
    return "\n".join(out)


def summary() -> str:
    """One row per command that runs something (groups: their subcommands), its short help."""
    rows = ["| command | what it does |", "| --- | --- |"]
    for words, cmd, _ in tree():
        if words and not getattr(cmd, "commands", None) or getattr(cmd, "invoke_without_command", False) and words:
            name = " ".join(("edge", *words))
            anchor = "-".join(name.split())
            rows.append(f"| [{code(name)}](#{anchor}) | {cell(cmd.get_short_help_str(limit=200))} |")
    return "\n".join(rows)


def reference() -> str:
    return "\n\n".join([summary(), *(_section(w, c, x) for w, c, x in tree() if w)])
