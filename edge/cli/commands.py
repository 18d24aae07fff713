"""The typer app: every command group registered (`edge --help` lists them all). `edge serve` as
the unit runs it does not come here (edge.cli.main dispatches it before typer is imported)."""

from __future__ import annotations

import typer

from edge.cli import doctor, engines, fleet, recovery, serve, units
from edge.cli.ota import ota_app  # light: its commands import what they need

__all__ = ["app"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: importing rich costs ~90 ms per call
                  help="edge: cold-start runtime for Jetson-class devices.\n\nDocs: docs/index.md")

for group in (serve, recovery, units, doctor, engines, fleet):
    group.register(app)

app.add_typer(ota_app, name="ota")
