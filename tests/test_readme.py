"""The README (and every page of docs/) names only what exists: every `edge` command and option (asked of the typer app
itself), every path under edge/, tests/, scripts/, systemd/, engines/ and .ci/, every script's
options, every dotted module reference (`edge.x.Y`, `kit.Y`, `harness.Y`, `benchmarks.x`), every test it names
(`tests/x.py::test_y`, the test that holds a statement), every name it places in a module
(`` `model_key`, `edge/lifecycle/loadset.py` ``) and every row of the module map."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import Any

import typer

from edge.cli import app
from kit.docs import section
from kit.layout import readme_floors

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The pages of docs/: what they name is held to the code like the README's (their code spans and blocks).
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))

# Options of other tools the README names beside them (pip, venv): not edge's to have.
FOREIGN_OPTIONS = {"--no-cache-dir": "pip install", "--system-site-packages": "python3 -m venv",
                   "--extra-index-url": "pip install", "--no-index": "pip install", "--upgrade": "pip install",
                   "--force-reinstall": "pip install", "--embd-normalize": "llama-server", "--embeddings": "llama-server",
                   "-ctk": "llama-server", "-ctv": "llama-server", "-ub": "llama-server", "-b": "llama-server"}
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
    text = README + "\n" + DOCS
    lines = [line for block in fenced.findall(text) for line in block.splitlines()]
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", fenced.sub("", text))]
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


def _script_sources(script: Path, args: list[str]) -> str:
    """The script and the Python file it runs (`scripts/demo` runs scripts/demo.py; `scripts/bench
    load` runs the module scripts/benchmarks/load.py, which must exist)."""
    text = script.read_text(errors="replace")
    for ran in re.findall(r"scripts/(\w+\.py)", text):
        text += (ROOT / "scripts" / ran).read_text(errors="replace")
    if script == ROOT / "scripts" / "bench" and args and not args[0].isupper():  # NAME: the placeholder
        bench = ROOT / "scripts" / "benchmarks" / f"{args[0]}.py"
        assert bench.is_file(), f"scripts/bench {args[0]}: no benchmark scripts/benchmarks/{bench.name}"
        text += bench.read_text(errors="replace")
    return text


def test_every_path_and_script_option_exists() -> None:
    checked = 0
    for text in _code():
        tokens = text.split()
        if not _PATH.fullmatch(tokens[0]) or "<" in tokens[0] or "*" in tokens[0]:
            continue
        path = ROOT / tokens[0].split("::")[0]  # tests/x.py::test_y: the test is checked below
        assert path.exists(), f"README names {tokens[0]}, which does not exist"
        checked += 1
        source = _script_sources(path, tokens[1:]) if tokens[0].startswith("scripts/") and path.is_file() else ""
        if 'pytest -q "$@"' in source:
            continue  # scripts/test: its options are pytest's
        for opt in (t for t in tokens[1:] if t.startswith("-")):
            known = f'"{opt}"' in source or re.search(rf"^\s*{re.escape(opt)}\)", source, re.M)  # sh `case`
            known = known or (opt == "--help" and "argparse" in source)  # argparse's own
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
    refs = {t for t in _code() if re.fullmatch(r"(?:edge|kit|harness|benchmarks)(?:\.[A-Za-z_]\w*)+", t)
            and t.split(".")[1] not in FILE_SUFFIXES and t not in MENDER_KEYS}
    assert "harness.PidOne" in refs
    unresolved = []
    for ref in sorted(refs):
        try:
            _resolve(ref)
        except (ImportError, AttributeError):
            unresolved.append(ref)
    assert unresolved == []


def test_module_map_names_real_modules_and_every_module() -> None:
    """Each row of the package table names its package and what it holds: every name in a
    package's `holds` cell is one of its modules (or a command group of cli/), every module of
    the package is named, and the ground floor's row names the top level's modules."""
    root = typer.main.get_command(app)
    floors = readme_floors(section("Layout"))  # docs/internals.md
    assert len(floors) >= 8
    for floor in floors:
        for unit in floor.units:
            rel = unit.removeprefix("edge.").replace(".", "/")
            folder = ROOT / "edge" / rel
            if not folder.is_dir():
                assert (ROOT / "edge" / f"{rel}.py").exists(), f"module map: edge/{rel}.py does not exist"
                continue
            modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
            subfolders = {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"}
            named = set(floor.holds)
            strangers = [n for n in named if re.fullmatch(r"[a-z_]+", n) and n not in modules
                         and not (rel == "cli" and n in root.commands)]
            assert not strangers, f"module map: edge/{rel}/ has no module {strangers}"
            missing = sorted((modules | subfolders) - named)
            assert not missing, f"module map: the row of edge/{rel}/ does not name {missing}"


def test_every_test_the_readme_names_exists() -> None:
    """A statement the README holds by a test (`tests/x.py::test_y`) names a test that is there."""
    refs = sorted({m.groups() for t in _code() for m in re.finditer(r"(tests/\S+?\.py)::(\w+)", t)})
    assert len(refs) >= 1
    missing = [f"{path}::{name}" for path, name in refs
               if not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M)]
    assert missing == []


def test_every_name_is_where_the_readme_places_it() -> None:
    """`name`, `edge/x.py` / `name` in `edge/x.py` / `name` (`edge/x.py`), in the README or a
    docs page: defined in that file (a function or class moved to another module makes the
    sentence false)."""
    text = " ".join((README + "\n" + DOCS).split())  # a sentence wraps across lines
    pairs = re.findall(r"`(\w+)(?:\(\))?`(?:,| in| of| from)? \(?`(edge/[\w/]+\.py)`", text)
    assert len(pairs) >= 3
    wrong = [f"`{name}` in {path}" for name, path in pairs
             if not re.search(rf"^(?:\s*(?:async )?def |\s*class ){name}\b|^{name}\s*[:=]", (ROOT / path).read_text(), re.M)]
    assert wrong == []


def test_json_schema_keywords_and_grammar_bounds_are_the_codes() -> None:
    """The json_schema keyword table (docs/api.md) is `KEYWORDS` (every keyword, each with its status),
    and "Grammar bounds" states `GRAMMAR_LIMITS` and `MAX_STACKS`."""
    from edge.serve.schema import GRAMMAR_LIMITS, KEYWORDS, MAX_OPTIONAL_PROPERTIES, MAX_STACKS

    keywords = section("json_schema keywords")
    rows = re.findall(r"^\| (.+?) \| (enforced|refused|ignored) \| (.*) \|$", keywords, re.M)
    table = {kw: (status, how) for names, status, how in rows for kw in re.findall(r"`([^`]+)`", names)}
    assert {k: status for k, (status, _) in table.items()} == {k: status for k, (status, _) in KEYWORDS.items()}
    assert all(how == KEYWORDS[k][1] for k, (status, how) in table.items() if status != "refused")
    bounds = section("Grammar bounds")
    for stated in (f"{GRAMMAR_LIMITS.bytes // 1024} KiB of GBNF", f"at most {GRAMMAR_LIMITS.nesting:,} nested groups",
                   f"at most {GRAMMAR_LIMITS.widest} wide", f"at most {MAX_OPTIONAL_PROPERTIES} optional properties",
                   f"at most {MAX_STACKS} grammar stacks"):
        assert stated in bounds, stated


def test_the_quick_start_is_the_two_commands_everywhere() -> None:
    """The README's quick start is the clone, then `scripts/demo` and `scripts/test`: scripts there
    are (CI runs the second), and the docs (the site's home, Install) show the very same block."""
    block = section("Quick start").split("```\n", 1)[1].split("```", 1)[0]
    commands = [line.split()[0] for line in block.splitlines()[1:]]
    assert block.startswith("git clone <this repo> edge && cd edge\n")
    assert commands == ["scripts/demo", "scripts/test"]
    assert all(os.access(ROOT / c, os.X_OK) for c in commands)
    assert "exec scripts/test" in (ROOT / ".ci" / "run").read_text()
    for page in ("docs/index.md", "docs/install.md"):
        assert f"```\n{block}```" in (ROOT / page).read_text(), page


def test_the_demo_sets_up_the_service_alone_and_the_tests_everything() -> None:
    """scripts/demo installs what the demo needs (`scripts/setup --device`: no scripts/setup.d
    part, whose Chromium, Prometheus and Mender start services of their own) and says what the
    first run costs; scripts/test keeps the full set-up. demo.py uses edge and the harness
    (scripts/harness), whose imports are the standard library's and edge's dependencies alone."""
    import ast

    demo, test, setup = ((ROOT / "scripts" / n).read_text() for n in ("demo", "test", "setup"))
    assert re.search(r"^scripts/setup --device$", demo, re.M) and "first run" in demo
    assert re.search(r"^scripts/setup$", test, re.M)
    loop = re.search(r'^if \[ "\$device" = 0 \]; then\n  for part in scripts/setup\.d/\*\.sh', setup, re.M)
    assert loop, "setup.d's parts are sourced only without --device"
    harness = ROOT / "scripts" / "harness"
    loaded = [ROOT / "scripts" / "demo.py", harness / "__init__.py",
              *(harness / f"{m}.py" for m in re.findall(r"^from harness\.(\w+) import", (harness / "__init__.py").read_text(),
                                                        re.M))]
    roots: set[str] = set()
    for path in loaded:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                roots |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                roots.add(n.module.split(".")[0])
    core = {re.split(r"[ <>=!;\[]", r)[0].lower().replace("_", "-")
            for r in importlib.metadata.requires("edge-coldstart") or [] if "extra ==" not in r}
    dists = importlib.metadata.packages_distributions()
    outside = {r for r in roots - {"edge", "harness"} - set(sys.stdlib_module_names)
               if not {d.lower().replace("_", "-") for d in dists.get(r, [])} & core}
    assert len(loaded) > 3 and outside == set(), outside  # all in a --device install
