"""`edge serve`, `edge warmup`, `edge status`, `edge bench`: the service and its start report."""

from __future__ import annotations

import json
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt, config_of
from edge.config import DEFAULT_URL
from edge.errors import EdgeError

__all__ = ["register"]


def serve(config: Optional[str] = ConfigOpt) -> None:
    """Load, lock and warm up the models, then serve on the inherited or configured socket."""
    from edge.timing import StartTimer

    timer = StartTimer()  # first: the report measures from exec, config parsing included
    from edge.start import ColdStart

    raise typer.Exit(ColdStart(config, timer=timer).run())


def warmup(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt,
           calibrate: bool = typer.Option(False, "--calibrate",
                                          help="measure the warm-up candidates anew and store the plan")) -> None:
    """Rehearse a start (page-in, load, lock, warm-up) without serving, and report each phase."""
    from edge.start import ColdStart
    from edge.timing import format_report

    report = ColdStart(config).rehearse(recalibrate=calibrate)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


def status(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Show the report of the last start: every phase with seconds, bytes and rates."""
    from edge.config import state_dir
    from edge.timing import REPORT_NAME, format_report, read_last_report

    cfg = config_of(config)
    report = read_last_report(state_dir(cfg))
    if report is None:
        typer.echo(f"no start report yet in {state_dir(cfg) / REPORT_NAME}: has `edge serve` run?", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


def bench(url: str = typer.Option(DEFAULT_URL, "--url", help="the running service"),
          requests: int = typer.Option(50, "--requests", min=1),
          concurrency: int = typer.Option(4, "--concurrency", min=1),
          prompt: str = typer.Option("Question: What is the capital of France?\nAnswer:", "--prompt"),
          max_tokens: int = typer.Option(16, "--max-tokens", min=1),
          model: Optional[str] = typer.Option(None, "--model")) -> None:
    """Latency and throughput of a running service (JSON): p50/p95/p99, requests/s, tokens/s."""
    from edge.bench import bench as run

    try:
        result = run(url, requests=requests, concurrency=concurrency, prompt=prompt,
                     max_tokens=max_tokens, model=model)
    except ValueError as exc:
        raise EdgeError(str(exc)) from None
    typer.echo(json.dumps(result, indent=2))
    if result["errors"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    for command in (serve, warmup, bench, status):
        app.command()(command)
