"""The `edge` command: one small module per command group, each turning flags into a config and
one call into the module that does the work. Every heavy import happens inside the command that
needs it, so `edge --help` stays fast and imports no native or HTTP stack.

`edge serve` as the unit runs it (`serve`, `serve --config FILE`) is dispatched here, before typer,
click or any other command's module is imported (edge.cli.launch): every start pays for what is
imported before its config is read. Any other form (`serve --help`, a typo) goes through the typer
app (edge.cli.commands), which answers it as before."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["app", "main", "plain_serve"]


def plain_serve(argv: list[str]) -> tuple[str | None] | None:
    """(the --config value or None) when argv is `serve` with at most a --config/-c; else None."""
    if not argv or argv[0] != "serve":
        return None
    rest = argv[1:]
    if not rest:
        return (None,)
    if len(rest) == 1 and rest[0].startswith("--config="):
        return (rest[0].split("=", 1)[1] or None,)
    if len(rest) == 2 and rest[0] in ("--config", "-c") and not rest[1].startswith("-"):
        return (rest[1] or None,)
    return None


# `edge reload` is a client that waits on the service's control socket; its interpreter and
# imports (~0.2 s of CPU) run this many nice steps down, below the threads serving requests.
CLIENT_NICE = 10


def lower_client(argv: list[str]) -> bool:
    """`edge reload` (ExecReload=, an operator, an OTA activation): this process steps back, and
    from its first instruction a SIGTERM (systemd stopping the unit during its reload) ends it
    with 0: the stop supersedes the reload (edge.cli.serve's handler says so once it runs)."""
    if argv[:1] != ["reload"]:
        return False
    import signal

    signal.signal(signal.SIGTERM, _superseded_early)
    try:
        os.nice(CLIENT_NICE)
    except OSError:
        return False
    return True


def _superseded_early(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def main() -> None:
    _hold_std_fds()
    lower_client(sys.argv[1:])
    plain = plain_serve(sys.argv[1:])
    watch = None
    if sys.argv[1:2] == ["serve"]:  # first: the watch sees every module compiled from here on
        from edge.bytecode import CompileWatch

        watch = CompileWatch()
    if plain is not None:
        from edge.cli.launch import serve

        sys.exit(_run(lambda: serve(plain[0], watch)))
    from edge.cli.output import guard, settle

    stdout = guard()  # every command's answer: one that cannot be written is 74, never a silent 0
    code, lost = settle(stdout, _run(lambda: _typer_app(watch)))
    if lost:
        _stderr(f"edge: error: {lost}")
    sys.exit(code)


def _typer_app(watch: Any) -> int:
    from edge.cli.commands import app as typer_app

    typer_app(obj=watch)  # standalone: it ends in SystemExit; the serve command's context carries the watch (edge.cli.serve)
    return 0


def _run(command: Any) -> int:
    """The exit code of `command()`: its return, its SystemExit, or an error's own code."""
    from edge.errors import EX_SOFTWARE, EdgeError

    try:
        return int(command() or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else _said(str(exc.code))
    except EdgeError as exc:
        _stderr(f"edge: error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception:  # a bug, not a bad input: its traceback once, and the code that says so
        _internal_error(EX_SOFTWARE)
        return EX_SOFTWARE


def _said(message: str) -> int:
    """sys.exit("text"): the text on stderr, exit 1 (as Python does)."""
    _stderr(message)
    return 1


def _hold_std_fds() -> None:
    """A descriptor 0, 1 or 2 the caller closed (`>&-`) gets /dev/null: a file the command opens
    must not take its number and receive what a library writes to stdout or stderr. Python saw it
    closed at startup (sys.stdout is None), so a command's answer still says stdout is closed."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _stderr(line: str) -> None:
    """One line on stderr; none where stderr is closed or cannot take it (the exit code remains)."""
    if sys.stderr is None:
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _internal_error(code: int) -> None:
    import logging
    import traceback

    log = logging.getLogger("edge")
    if log.handlers:  # `edge serve` set up logging (the journal under systemd): the traceback goes there
        log.critical("internal error; exiting %d", code, exc_info=True)
    elif sys.stderr is not None:
        try:
            traceback.print_exc()
        except OSError:
            pass
        _stderr(f"edge: internal error (a bug: please report the traceback above); exiting {code}")


def __getattr__(name: str) -> Any:
    """`edge.cli.app`, the typer app, imported when asked for (the tests read its commands)."""
    if name == "app":
        from edge.cli.commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
