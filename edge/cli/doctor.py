"""`edge doctor` and `edge device`: what this machine is, and what a start on it needs."""

from __future__ import annotations

import json
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt

__all__ = ["register"]


def doctor(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Check config, model files, mlock limits, memory and units; explain each fix.

    Docs: docs/deploy.md#4-check-before-the-first-start"""
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
    """What this machine is: Jetson module, L4T, SM arch, CUDA, TensorRT, ONNX Runtime, and the
    CPU paths llama.cpp uses (and any edge turned off, with why).

    Docs: docs/install.md#per-platform"""
    from edge.device.identity import detect
    from edge.model.cpupaths import llama_cpu

    info, llama = detect().as_dict(), llama_cpu()
    if as_json:
        typer.echo(json.dumps({**info, "llama_cpp": llama.as_dict()}, indent=2))
        return
    lines = [f"{k:<14}{v if v is not None else '-'}" for k, v in info.items()]
    lines += [f"{'llama.cpp' if i == 0 else '':<14}{line}" for i, line in enumerate(llama.lines())]
    typer.echo("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(device)
