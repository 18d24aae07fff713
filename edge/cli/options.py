"""Options shared by several commands, and the one place a --config flag becomes a Config."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from edge.config import Config, load
from edge.fsutil import cannot_create

__all__ = ["ConfigOpt", "JsonOpt", "config_of", "http_url", "output_file", "url_of"]


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
    """A callback for an option naming a file to write at the end (--svg): checked before any work
    is done, so that a bad path is a usage error (exit 2), not a failure after the work."""
    why = None if value is None else cannot_create(value)
    if why:
        raise typer.BadParameter(why)
    return value


def http_url(value: Optional[str]) -> Optional[str]:
    """A callback for an option naming an http(s):// URL with a host (--remote-write)."""
    return url_of(value, ("http", "https"))


def url_of(value: Optional[str], schemes: tuple[str, ...]) -> Optional[str]:
    """`value` if it is a URL of one of `schemes` with a host; else a usage error (exit 2)."""
    import urllib.parse

    if value is None:
        return None
    try:
        u = urllib.parse.urlsplit(value)
        u.port  # noqa: B018  (a port out of range or not a number raises here)
    except ValueError as exc:
        raise typer.BadParameter(f"expected a URL, found {value!r} ({exc})") from None
    if u.scheme not in schemes or not u.hostname:
        raise typer.BadParameter(f"expected an {' or '.join(f'{x}://' for x in schemes)} URL with a host, "
                                 f"found {value!r}")
    return value


def a_file(what: str):
    """A callback: the option (one path, none, or a repeated option's list) names files that exist."""
    def check(value: Any) -> Any:
        for v in value if isinstance(value, list) else [] if value is None else [value]:
            if not v.is_file():
                found = "is a directory" if v.is_dir() else "is not a file" if v.exists() else "does not exist"
                raise typer.BadParameter(f"{v} {found}; expected {what}")
        return value
    return check


def a_folder(value: Optional[Path]) -> Optional[Path]:
    if value is not None and not value.is_dir():
        found = "is not a folder" if value.exists() else "does not exist"
        raise typer.BadParameter(f"{value} {found}; expected an engine store (a folder that exists)")
    return value


def one_of(value: Optional[str], choices: list[str]) -> Optional[str]:
    if value is not None and value not in choices:
        raise typer.BadParameter(f"expected one of {', '.join(choices)}, found {value!r}")
    return value
