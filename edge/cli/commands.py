"""The typer app: every command group registered (`edge --help` lists them all). `edge serve` as
the unit runs it does not come here (edge.cli.main dispatches it before typer is imported)."""

from __future__ import annotations

import typer

# each group's module by its own name: this module is imported by the package (edge.cli), so it
# does not import the package back
import edge.cli.doctor as doctor
import edge.cli.engines as engines
import edge.cli.fleet as fleet
import edge.cli.recovery as recovery
import edge.cli.serve as serve
import edge.cli.units as units
from edge.cli.ota import ota_app  # light: its commands import what they need

__all__ = ["app"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: importing rich costs ~90 ms per call
                  help="edge: cold-start runtime for Jetson-class devices.\n\nDocs: docs/index.md")

for group in (serve, recovery, units, doctor, engines, fleet):
    group.register(app)

app.add_typer(ota_app, name="ota")
