"""The README names only what exists: every `edge` command and option (asked of the typer app
itself), every path under edge/, tests/, scripts/, systemd/, engines/ and .ci/, every script's
options, every dotted module reference (`edge.x.Y`, `kit.Y`) and every row of the module map."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import typer

from edge.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Options of other tools the README names beside them (pip, venv): not edge's to have.
FOREIGN_OPTIONS = {"--no-cache-dir": "pip install", "--system-site-packages": "python3 -m venv",
                   "--extra-index-url": "pip install"}
# Names `edge.<x>` that are Mender provides/depends keys (scripts/mender/write-artifact), not modules.
MENDER_KEYS = {"edge.bundle_version", "edge.content_digest"}
# Names `edge.<x>` that are files, not modules (edge.toml, edge.socket, edge.service, ...).
FILE_SUFFIXES = {"toml", "socket", "service", "sock", "json", "edgeb", "pub", "key"}
_PATH = re.compile(r"(?:edge|tests|scripts|systemd|engines|\.ci)/\S*")
_EDGE = re.compile(r"(?:.*/bin/|.*=-?)?edge")  # edge, /opt/edge/venv/bin/edge, ExecStartPre=-edge
_WORDS = re.compile(r"[a-z][a-z0-9-]*(?:\\?\|[a-z][a-z0-9-]*)*")  # a command, or `a\|b` alternatives


def _code() -> list[str]:
    """Every inline code span (whitespace folded) and every line of a fenced block, each command
    of a `|`, `&&` or `;` list apart, without its shell comment."""
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
    lines = [line for block in fenced.findall(README) for line in block.splitlines()]
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", fenced.sub("", README))]
    out = []
    for text in spans + lines:
        text = re.sub(r"\s#.*", "", text)
        out += [part.strip() for part in re.split(r"\s(?:\||&&|;)\s", text) if part.strip()]
    return out


def _is_group(cmd: Any) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)  # typer's groups are not click.Group


def _options(cmd: Any) -> set[str]:
    opts = {"--help"}
    for p in cmd.params:
        opts.update(p.opts)
        opts.update(p.secondary_opts)
    return opts


def _check_command(root: Any, tokens: list[str]) -> list[str]:
    """Problems with `edge <tokens>`: a subcommand or an option that does not exist."""
    cmds: list[Any] = [root]
    words = ["edge"]
    rest = iter(tokens)
    for token in rest:
        token = token.strip("[]")
        if token.startswith("-"):
            name = token.split("=")[0]
            if not any(name in _options(c) for c in cmds):
                return [f"`{' '.join(words)}` has no option {name}"]
            continue
        groups = [c for c in cmds if _is_group(c)]
        if not groups or not _WORDS.fullmatch(token):
            continue  # an argument or an option's value
        nxt = []
        for name in re.split(r"\\?\|", token):
            found = [g.commands[name] for g in groups if name in g.commands]
            if not found:
                return [f"`{' '.join(words)}` has no command {name!r}"]
            nxt += found
        cmds, words = nxt, words + [token]
    return []


def _edge_commands() -> list[list[str]]:
    found = []
    for text in _code():
        tokens = text.split()
        for i, token in enumerate(tokens):
            if _EDGE.fullmatch(token):
                found.append(tokens[i + 1:])
                break
    return found


def test_every_edge_command_and_option_exists() -> None:
    root = typer.main.get_command(app)
    commands = _edge_commands()
    assert len(commands) > 30  # the parser found the README's commands at all
    problems = [p for tokens in commands for p in _check_command(root, tokens)]
    assert problems == []


def test_every_option_named_alone_exists() -> None:
    """`--calibrate`, `--restart-cmd`, ...: an option of some edge command or some script."""
    root = typer.main.get_command(app)

    def walk(cmd: Any) -> set[str]:
        sub = cmd.commands.values() if _is_group(cmd) else []
        return _options(cmd).union(*(walk(c) for c in sub))

    known = walk(root)
    scripts = "\n".join(p.read_text(errors="replace") for p in (ROOT / "scripts").rglob("*") if p.is_file())
    alone = {t.split()[0] for t in _code() if re.fullmatch(r"--?[a-z][a-z0-9-]*(?: \S+)?", t)}
    assert "--calibrate" in alone and "--restart-cmd" in alone
    missing = [o for o in sorted(alone) if o not in known and f'"{o}"' not in scripts
               and o not in FOREIGN_OPTIONS]
    assert missing == []


def _script_sources(script: Path) -> str:
    """The script and the Python file it runs (`scripts/bench-load` runs scripts/bench_load.py)."""
    text = script.read_text(errors="replace")
    for ran in re.findall(r"scripts/(\w+\.py)", text):
        text += (ROOT / "scripts" / ran).read_text(errors="replace")
    return text


def test_every_path_and_script_option_exists() -> None:
    checked = 0
    for text in _code():
        tokens = text.split()
        if not _PATH.fullmatch(tokens[0]) or "<" in tokens[0] or "*" in tokens[0]:
            continue
        path = ROOT / tokens[0]
        assert path.exists(), f"README names {tokens[0]}, which does not exist"
        checked += 1
        source = _script_sources(path) if tokens[0].startswith("scripts/") and path.is_file() else ""
        if 'pytest -q "$@"' in source:
            continue  # scripts/test: its options are pytest's
        for opt in (t for t in tokens[1:] if t.startswith("-")):
            known = f'"{opt}"' in source or re.search(rf"^\s*{re.escape(opt)}\)", source, re.M)  # sh `case`
            assert known, f"README: {text!r}: {tokens[0]} has no option {opt}"
    assert checked > 30


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_dotted_module_reference_resolves() -> None:
    refs = {t for t in _code() if re.fullmatch(r"(?:edge|kit)(?:\.[A-Za-z_]\w*)+", t)
            and t.split(".")[1] not in FILE_SUFFIXES and t not in MENDER_KEYS}
    assert "kit.PidOne" in refs
    unresolved = []
    for ref in sorted(refs):
        try:
            _resolve(ref)
        except (ImportError, AttributeError):
            unresolved.append(ref)
    assert unresolved == []


def _module_map() -> list[tuple[list[str], list[str]]]:
    section = README.split("| module | owns |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in section.splitlines()[2:]:
        cells = line.strip("|").split(" | ", 1)
        rows.append(tuple(re.findall(r"`([^`]+)`", c) for c in cells))
    return rows


def test_module_map_names_real_modules() -> None:
    root = typer.main.get_command(app)
    rows = _module_map()
    assert len(rows) > 10
    for modules, owns in rows:
        for m in modules:
            assert (ROOT / "edge" / m).exists(), f"module map: edge/{m} does not exist"
        for name in owns:
            if name.endswith(".py"):
                assert (ROOT / "edge" / name).exists(), f"module map: edge/{name} does not exist"
        folder = next((m for m in modules if m.endswith("/")), None)
        for name in (n for n in owns if folder and re.fullmatch(r"[a-z_]+", n)):
            module = (ROOT / "edge" / folder / f"{name}.py").exists()
            command = folder == "cli/" and name in root.commands
            assert module or command, f"module map: {folder} has no module {name!r}"
