"""`edge serve` as the unit runs it: dispatched before typer is imported, and importing before its
config phase only the modules on a budget (a list of modules, not a time); every other form of
the command line still goes through the typer app, and `edge --help` lists every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from edge.cli import app, plain_serve
from kit import EDGE

# What `edge serve` may have imported of edge when its config phase begins: the CLI's dispatch, the
# timer, the config, the start journal (opened before the config is read) and the start's own
# modules. A module added here is paid by every start of every device before anything else.
EDGE_BEFORE_CONFIG = {
    "edge", "edge.builtin_models", "edge.cli", "edge.cli.launch", "edge.config", "edge.errors", "edge.fleet",
    "edge.fleet.crashes", "edge.fleet.history", "edge.fleet.journal", "edge.fsutil", "edge.lifecycle",
    "edge.bytecode", "edge.lifecycle.installed", "edge.lifecycle.loader", "edge.lifecycle.loadset",
    "edge.lifecycle.handover", "edge.lifecycle.handover.priority", "edge.lifecycle.recovery", "edge.lifecycle.safemode", "edge.lifecycle.start",
    "edge.lifecycle.signals", "edge.lifecycle.systemd", "edge.prefixconfig", "edge.timing", "edge.toml",
    "edge.engineconfig",  # the config's engine tables
    # the recovery phase, before the config by design: a give-up is seen before anything else runs,
    # and the cgroup's OOM-kill count is noted for the next process's record
    "edge.fleet.giveup", "edge.device", "edge.device.cgroup",
}
# Never before the config: the other commands' stack, and what the load and the HTTP server import
# beside the model's load (asyncio included: uvicorn imports it there anyway).
NOT_BEFORE_CONFIG = {"typer", "click", "rich", "asyncio", "ssl", "concurrent", "numpy", "llama_cpp", "starlette",
                     "uvicorn", "h11", "anyio", "prometheus_client", "edge.cli.commands", "edge.cli.doctor",
                     "edge.host", "edge.serve", "edge.model", "edge.engines", "edge.lifecycle.handover.handover"}

_SNAPSHOT = """\
import json, sys
from edge.timing import StartTimer
seen = []
phase = StartTimer.phase
def watched(self, name, **detail):
    if name == "config" and not seen:
        seen.append(sorted(sys.modules))
    return phase(self, name, **detail)
StartTimer.phase = watched
sys.argv = ["edge", "serve", "--config", sys.argv[1]]
from edge.cli import main
try:
    main()
finally:
    print(json.dumps(seen[0] if seen else None), file=sys.stderr)
"""


def _modules_at_config(cfg: Path) -> tuple[set[str], int]:
    """sys.modules as `edge serve` enters its config phase (the config is invalid: it stops there)."""
    r = subprocess.run([sys.executable, "-c", _SNAPSHOT, str(cfg)], capture_output=True, text=True, timeout=120)
    seen = json.loads(r.stderr.strip().splitlines()[-1])
    assert seen is not None, r.stderr
    return set(seen), r.returncode


def _interpreter_modules() -> set[str]:
    """What this Python imports before any code runs (site, the venv's .pth files)."""
    r = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(r.stdout))


def test_serve_imports_only_its_budget_before_the_config(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text('[server]\nport = "not a port"\n')
    modules, code = _modules_at_config(cfg)
    assert code == 78  # the config phase ran, and failed on the field
    edge = {m for m in modules if m == "edge" or m.startswith("edge.")}
    assert edge <= EDGE_BEFORE_CONFIG, f"imported before the config, not on the budget: {sorted(edge - EDGE_BEFORE_CONFIG)}"
    assert {"edge.config", "edge.lifecycle.start", "edge.cli.launch"} <= edge  # the snapshot is of a real start
    tops = {m.split(".")[0] for m in modules} | modules
    assert not NOT_BEFORE_CONFIG & tops, sorted(NOT_BEFORE_CONFIG & tops)
    third = {m.split(".")[0] for m in modules - _interpreter_modules()} - set(sys.stdlib_module_names) - {"edge"}
    assert not {t for t in third if not t.startswith("_")}, f"third-party modules before the config: {sorted(third)}"


@pytest.mark.parametrize(("argv", "plain"), [
    (["serve"], (None,)), (["serve", "--config", "a.toml"], ("a.toml",)), (["serve", "-c", "a.toml"], ("a.toml",)),
    (["serve", "--config=a.toml"], ("a.toml",)), (["serve", "--config="], (None,)),
    (["serve", "--help"], None), (["serve", "--config"], None), (["serve", "--config", "--help"], None),
    (["serve", "-c", "a.toml", "extra"], None), (["serve", "--bogus"], None), (["status"], None), ([], None),
])
def test_only_the_plain_serve_skips_the_typer_app(argv: list[str], plain: tuple[str | None] | None) -> None:
    assert plain_serve(argv) == plain


def test_help_lists_every_command_and_serve_help_still_works() -> None:
    r = subprocess.run([*EDGE, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    commands = typer.main.get_command(app).commands
    assert len(commands) > 10
    missing = [name for name in commands if name not in r.stdout]
    assert not missing, f"`edge --help` does not list {missing}"
    r = subprocess.run([*EDGE, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--config" in r.stdout


def test_a_usage_error_of_serve_is_typers(tmp_path: Path) -> None:
    r = subprocess.run([*EDGE, "serve", "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--bogus" in r.stderr and "Traceback" not in r.stderr


def test_edge_reload_steps_back_from_the_cpu_and_nothing_else_does() -> None:
    """`edge reload` waits on the control socket: its start must not take the serving threads'
    cores (edge.cli.lower_client); `edge serve` and every other command keep their priority."""
    probe = ("import json, os, sys; from edge.cli import lower_client; before = os.getpriority(os.PRIO_PROCESS, 0); "
             "got = lower_client(sys.argv[1:]); print(json.dumps([got, os.getpriority(os.PRIO_PROCESS, 0) - before]))")
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    step = min(19, nice + 10) - nice  # nice values stop at 19
    for argv, expected in ((["reload", "--config", "x"], [True, step]), (["serve"], [False, 0]), (["status"], [False, 0])):
        r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == expected, argv


def test_edge_reload_ends_with_0_on_sigterm_from_its_first_instruction() -> None:
    """systemd stops a reloading unit by signals, ExecReload='s process included: a `edge reload`
    killed by SIGTERM would fail the unit (result 'signal'), even while it is still importing."""
    probe = ("import os, signal, sys; from edge.cli import lower_client; lower_client(['reload']); "
             "os.kill(os.getpid(), signal.SIGTERM); sys.exit(3)")  # the handler runs before the next line
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
