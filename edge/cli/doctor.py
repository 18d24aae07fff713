"""`edge doctor` and `edge device`: what this machine is, and what a start on it needs."""

from __future__ import annotations

import json
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt

__all__ = ["register"]


def doctor(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Check config, model files, mlock limits, memory and units; explain each fix."""
    from edge.host.doctor import run_checks
    from edge.host.units import unit_dir

    checks = run_checks(config, [unit_dir("/", False), unit_dir("/", True)])
    if as_json:
        typer.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        for c in checks:
            typer.echo(f"[{c.level.upper():>4}] {c.name}: {c.message}")
            if c.fix:
                typer.echo(f"       fix: {c.fix}")
    if any(c.level == "fail" for c in checks):
        raise typer.Exit(1)


def device(as_json: bool = JsonOpt) -> None:
    """What this machine is: Jetson module, L4T, SM arch, CUDA, TensorRT, ONNX Runtime."""
    from edge.device.identity import detect

    info = detect().as_dict()
    typer.echo(json.dumps(info, indent=2) if as_json else
               "\n".join(f"{k:<14}{v if v is not None else '-'}" for k, v in info.items()))


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(device)
