"""The `edge` command: one small module per command group, each turning flags into a config and
one call into the module that does the work. Every heavy import happens inside the command that
needs it, so `edge --help` stays fast and imports no native or HTTP stack."""

from __future__ import annotations

import logging
import os
import sys
import traceback

import typer

from edge.cli import doctor, engines, fleet, recovery, serve, units
from edge.errors import EX_SOFTWARE, EdgeError

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: importing rich costs ~90 ms per call
                  help="edge: cold-start runtime for Jetson-class devices.\n\nDocs: docs/index.md")

for group in (serve, recovery, units, doctor, engines, fleet):
    group.register(app)

from edge.cli.ota import ota_app  # noqa: E402  (light: its commands import what they need)

app.add_typer(ota_app, name="ota")


def main() -> None:
    _hold_std_fds()
    try:
        app()
    except EdgeError as exc:
        _stderr(f"edge: error: {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # a bug, not a bad input: its traceback once, and the code that says so
        _internal_error()
        sys.exit(EX_SOFTWARE)


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


def _internal_error() -> None:
    log = logging.getLogger("edge")
    if log.handlers:  # `edge serve` set up logging (the journal under systemd): the traceback goes there
        log.critical("internal error; exiting %d", EX_SOFTWARE, exc_info=True)
    elif sys.stderr is not None:
        try:
            traceback.print_exc()
        except OSError:
            pass
        _stderr(f"edge: internal error (a bug: please report the traceback above); exiting {EX_SOFTWARE}")
