"""Options shared by several commands, and the one place a --config flag becomes a Config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import typer

from edge.config import Config, load

__all__ = ["ConfigOpt", "JsonOpt", "config_of", "output_file"]


def _config_path(value: Optional[str]) -> Optional[str]:
    # The one callback: an absent flag stays None so that the lookup order applies.
    return value or None


ConfigOpt = typer.Option(None, "--config", "-c", callback=_config_path,
                         help="TOML config (default: $EDGE_CONFIG, /etc/edge/edge.toml if present, "
                              "else the embedded default model)")
JsonOpt = typer.Option(False, "--json", help="print as JSON")


def config_of(config: Optional[str]) -> Config:
    """The config named by --config, else the lookup order's (`edge.config.load`)."""
    return load(config)


def output_file(value: Optional[Path]) -> Optional[Path]:
    """A callback for an option naming a file to write at the end (--svg, -o): checked before any
    work is done, by a real file made and removed beside it, so that a bad path is a usage error
    (exit 2) and not a failure after the work."""
    if value is None:
        return None
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a directory; expected a file name")
    folder = value.parent
    if not folder.is_dir():
        raise typer.BadParameter(f"{value}: its folder {folder} does not exist")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{value.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise typer.BadParameter(f"{value}: cannot write in {folder}: {exc.strerror or exc}") from None
    return value
