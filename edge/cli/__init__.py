"""The `edge` command: one small module per command group, each turning flags into a config and
one call into the module that does the work. Every heavy import happens inside the command that
needs it, so `edge --help` stays fast and imports no native or HTTP stack."""

from __future__ import annotations

import logging
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
    try:
        app()
    except EdgeError as exc:
        print(f"edge: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # a bug, not a bad input: its traceback once, and the code that says so
        _internal_error()
        sys.exit(EX_SOFTWARE)


def _internal_error() -> None:
    log = logging.getLogger("edge")
    if log.handlers:  # `edge serve` set up logging (the journal under systemd): the traceback goes there
        log.critical("internal error; exiting %d", EX_SOFTWARE, exc_info=True)
    else:
        traceback.print_exc()
        print(f"edge: internal error (a bug: please report the traceback above); exiting {EX_SOFTWARE}",
              file=sys.stderr)
