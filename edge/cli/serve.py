"""`edge serve`, `edge reload`, `edge warmup`, `edge status`, `edge bench`: the service, its
reloads and their reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt, config_of, output_file, url_of
from edge.config import DEFAULT_URL
from edge.errors import EdgeError

__all__ = ["register"]


def serve(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Load, lock and warm up the models, then serve on the inherited or configured socket.

    Docs: docs/deploy.md"""
    from edge.cli.launch import serve as run

    raise typer.Exit(run(config, ctx.obj))  # ctx.obj: the compile watch edge.cli.main made first


SvgOpt = typer.Option(None, "--svg", callback=output_file,
                      help="also draw the report as an SVG timeline into this file")


def warmup(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt,
           calibrate: bool = typer.Option(False, "--calibrate",
                                          help="measure the warm-up candidates anew and store the plan"),
           svg: Optional[Path] = SvgOpt) -> None:
    """Rehearse a start (page-in, load, lock, warm-up) without serving, and report each phase.

    Docs: docs/internals.md#cold-start-phase-by-phase"""
    from edge.lifecycle.start import ColdStart
    from edge.cli.reports import format_report

    report = ColdStart(config).rehearse(recalibrate=calibrate)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    if svg is not None:
        from edge.fleet.timeline import chart_of

        _write_svg(svg, [chart_of(report)])


def _write_svg(path: Path, charts: list[Any]) -> None:
    from edge.fsutil import atomic_write
    from edge.fleet.timeline import render_svg

    try:
        atomic_write(path, render_svg(charts), mode=None)  # the file asked for, as the umask makes it
    except OSError as exc:
        raise EdgeError(f"--svg {path}: cannot write it: {exc.strerror or exc}") from None
    typer.echo(f"timeline written to {path}", err=True)


def reload(config: Optional[str] = typer.Option(
               None, "--config", "-c", help="the config to load (default: the one the service was "
               "started with); its state directory also locates the service's control socket"),
           timeout: float = typer.Option(600.0, "--timeout", min=1.0,
                                         help="give up (the old set keeps serving) after this many seconds"),
           socket_path: Optional[str] = typer.Option(None, "--socket", help="the service's control "
                                                     "socket (default: <state_dir>/control.sock)"),
           process: Optional[bool] = typer.Option(None, "--process/--in-place", help="hand over to a new "
                                                  "process / reload in place (default: a new process only "
                                                  "when the installed edge, llama.cpp or unit environment "
                                                  "is not what runs)"),
           as_json: bool = JsonOpt) -> None:
    """Reload the running service without a gap: the new set is loaded and warmed beside the old
    one (in the same process, or in a new one that takes over), then takes the traffic. Exit 0
    once it serves; else the error's exit code and why (the old set keeps serving). SIGTERM
    (systemd stopping the unit while this runs as its ExecReload=): exit 0 at once, the reload
    superseded by the stop.

    Docs: docs/reload.md"""
    import os
    import signal

    from edge.lifecycle.control import control_path, request_reload
    from edge.errors import ConfigError

    if config and not Path(config).exists():  # anything else wrong with it, the service reports
        raise ConfigError(config, "", "config file does not exist")
    target = str(Path(config).resolve()) if config else None
    path = Path(socket_path) if socket_path else control_path(_config_for_state(config))
    signal.signal(signal.SIGTERM, _superseded)
    answer = request_reload(path, target, timeout, process, dict(os.environ))
    # answered: a stop from now on (while this prints and exits) must not kill it mid-exit either
    # (Python's finalization puts SIGTERM's default back); ignored, it ends with its own code
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
    if not answer.get("ok"):
        if not as_json:
            typer.echo(f"edge: reload failed: {answer.get('error')}", err=True)
        raise typer.Exit(int(answer.get("exit_code") or 70))
    r = answer.get("report") or {}
    if not as_json and r.get("reload_kind") == "process":
        typer.echo(f"{answer.get('status')}\nhanded over to pid {(r.get('successor') or {}).get('pid')} "
                   f"({'; '.join(r.get('why') or [])}); mode: {r.get('mode')} ({(r.get('memory') or {}).get('reason', '')})")
    elif not as_json:
        typer.echo(f"{answer.get('status')}\nkept: {', '.join(r.get('kept') or []) or '-'}; "
                   f"loaded: {', '.join(r.get('loaded') or []) or '-'}; mode: {r.get('mode')} "
                   f"({(r.get('memory') or {}).get('reason', '')})")
        for field in r.get("needs_restart") or []:
            typer.echo(f"note: {field} changed: applied at the next restart, not by a reload", err=True)


def _config_for_state(config: Optional[str]) -> Any:
    """The config whose state_dir names the control socket (or keeps the reports). An invalid
    config is still sent to the service (which reports the error and keeps serving), or failed
    the start: its state dir is the one the start used (edge.lifecycle.recovery.early_state_dir)."""
    from edge.config import PathsConfig, default_config
    from edge.errors import ConfigError
    from edge.lifecycle.recovery import early_state_dir

    try:
        return config_of(config)
    except ConfigError:
        paths = PathsConfig(state_dir=str(early_state_dir(config)))
        return dataclasses.replace(default_config(), paths=paths)


def status(config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt, svg: Optional[Path] = SvgOpt) -> None:
    """Show the reports of the last start and of the last reload: phases, seconds, bytes, rates;
    and a start that failed after it, if one did. A damaged report is named (exit 1), the others
    are still shown.

    Docs: docs/deploy.md#6-see-it-serve"""
    from edge.fleet.history import FAILED_START
    from edge.timing import REPORT_NAME, visible

    from edge.fleet.crashes import recent_crashes
    from edge.fleet.giveup import GiveUp
    from edge.lifecycle.safemode import SafeMode

    folder = _state_folder(_config_for_state(config))
    damaged: list[str] = []
    report = _read_report(folder, "start", damaged)
    failed = _read_report(folder, FAILED_START, damaged)
    if failed is not None and report is not None and _newer(report, failed):
        failed = None  # an earlier failure, followed by a good start
    crashes, safe = recent_crashes(folder), SafeMode.load(folder).describe()
    give_up = GiveUp.load(folder)
    given_up = give_up.as_dict() if give_up is not None else None
    if report is None and failed is None and not damaged and not crashes:
        typer.echo(f"no start report yet in {folder / REPORT_NAME}: has `edge serve` run?", err=True)
        raise typer.Exit(1)
    reload_report = _read_report(folder, "reload", damaged) if report is not None else None
    if reload_report is not None and report.get("pid") not in (reload_report.get("pid"), _successor(reload_report)):
        reload_report = None  # a reload of an earlier run of the service, not of this one (nor its handover to it)
    if as_json:  # the start report as before, the last reload (and a later failed start) beside it
        typer.echo(json.dumps({**(report or {}), "last_reload": reload_report, "last_failed_start": failed,
                               "crashed_starts": crashes, "safe_mode": safe, "given_up": given_up}, indent=2))  # ASCII: \u202e
    else:
        _print_reports(folder, report, reload_report, failed, damaged)
        typer.echo(visible(_format_recovery(crashes, safe, given_up)), nl=False)
    for why in damaged:
        typer.echo(visible(f"edge: {why}"), err=True)
    if svg is not None:
        import time

        from edge.fleet.timeline import chart_of, recovery_chart

        drawn = [chart_of(r, k) for r, k in ((report, "start"), (reload_report, "reload"), (failed, "start")) if r]
        _write_svg(svg, drawn + [c for c in [recovery_chart(crashes, safe, time.time())] if c])
    if damaged:
        raise typer.Exit(1)


def _superseded(sig: int, frame: Any) -> None:
    """SIGTERM while waiting for the answer: systemd stops the unit during its reload (systemd
    252 stops a reloading unit by signals, ExecReload='s process included, whose death by SIGTERM
    would fail the unit with result 'signal'); the stop supersedes the reload."""
    typer.echo("edge reload: SIGTERM: the service is being stopped; the reload is superseded by the stop", err=True)
    raise SystemExit(0)


def _successor(reload_report: dict[str, Any]) -> Any:
    """The process a handover (a reload by a new process) handed the service to."""
    return (reload_report.get("successor") or {}).get("pid") if isinstance(reload_report.get("successor"), dict) else None


def _state_folder(cfg: Any) -> Path:
    from edge.config import state_dir
    from edge.errors import ConfigError

    folder = state_dir(cfg)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(cfg.source, "paths.state_dir", f"{folder} is not a directory")
    return folder


def _read_report(folder: Path, kind: str, damaged: list[str]) -> Optional[dict[str, Any]]:
    """The last report of this kind; None if there is none, or if it is damaged (why: in `damaged`)."""
    from edge.timing import UnreadableReport, read_last_report

    try:
        return read_last_report(folder, kind=kind)
    except UnreadableReport as exc:
        damaged.append(str(exc))
        return None


def _print_reports(folder: Path, report: Any, reload_report: Any, failed: Any, damaged: list[str]) -> None:
    """Each report as a table; one whose fields cannot be shown is named in `damaged` instead."""
    from edge.fleet.history import FAILED_START
    from edge.cli.reports import format_reload_report, format_report
    from edge.timing import visible

    shown = False
    for r, kind, render in ((report, "start", format_report), (reload_report, "reload", format_reload_report),
                            (failed, FAILED_START, _format_failed)):
        if r is None:
            continue
        try:
            text = render(r)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            damaged.append(f"report {folder / f'last-{kind}.json'} is unreadable: {type(exc).__name__}: {exc}")
            continue
        typer.echo(("\n" if shown else "") + visible(text))
        shown = True


def _format_recovery(crashes: list[dict[str, Any]], safe: list[dict[str, Any]],
                     given_up: dict[str, Any] | None = None) -> str:
    """Crashes (before READY and after it, with their cause), safe mode's steps and a give-up,
    after the reports."""
    lines = []
    if crashes:
        lines += ["", f"CRASHES (last {len(crashes)})",
                  f"{'at':<26}{'pid':>8}  {'phase':<19}{'signal':<9}{'cause':<14}what"]
        for c in crashes:
            on = c.get("model") or c.get("engine") or ""
            lines.append(f"{c.get('at') or '?':<26}{c.get('pid') or '?':>8}  {c.get('phase') or '?':<19}"
                         f"{c.get('signal') or '?':<9}{c.get('cause') or '?':<14}{c.get('result')}"
                         f"{' (' + on + ')' if on else ''}{'' if c.get('settled', True) else ', not recorded yet'}")
    for s in safe:
        lines += ["", f"SAFE MODE {s['target']}: {s['fallback']} since {s['since']} ({s['reason']}); "
                      "`edge safe-mode clear` ends it"]
    if given_up is not None:
        lines += ["", f"GIVEN UP since {given_up['since']}: {given_up['reason']}; every request is answered 503 "
                      "until `edge safe-mode clear`, another config, model, llama.cpp or edge, or the retry at "
                      f"{given_up['retry_at']}"
                      + (" (being retried now)" if given_up.get("retrying") else "")]
    return "\n".join(lines) + ("\n" if lines else "")


def _newer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    from edge.fleet.history import timestamp

    return (timestamp(a.get("started_at")) or 0) >= (timestamp(b.get("started_at")) or 0)


def _format_failed(r: dict[str, Any]) -> str:
    from edge.cli.reports import format_report

    table = format_report({**r, "sockets": []}).split("\n", 2)[2]  # its phases, without the head
    how = f"exit {r['exit_code']}" if r.get("exit_code") is not None else f"signal {r.get('signal', 'unknown')}"
    return (f"LAST START {str(r.get('result') or 'failed').upper()}: {r.get('started_at')}  pid {r.get('pid')}  "
            f"after {r.get('ready_s', 0):.3f} s, {how}: {r.get('error')}\n{table}")


def bench(url: str = typer.Option(DEFAULT_URL, "--url", callback=lambda v: url_of(v, ("http",)),
                                 help="the running service"),
          requests: int = typer.Option(50, "--requests", min=1, help="requests in all"),
          concurrency: int = typer.Option(4, "--concurrency", min=1, help="clients sending at once"),
          prompt: str = typer.Option("Question: What is the capital of France?\nAnswer:", "--prompt",
                                     help="the completion prompt every request sends"),
          max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="max_tokens of each request"),
          model: Optional[str] = typer.Option(None, "--model", help="the model asked (default: the first)")) -> None:
    """Latency and throughput of a running service (JSON): p50/p95/p99, requests/s, tokens/s.

    Docs: docs/performance.md"""
    from edge.serve.bench import bench as run

    try:
        result = run(url, requests=requests, concurrency=concurrency, prompt=prompt,
                     max_tokens=max_tokens, model=model)
    except ValueError as exc:
        raise EdgeError(str(exc)) from None
    typer.echo(json.dumps(result, indent=2))
    if result["errors"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    for command in (serve, reload, warmup, bench, status):
        app.command()(command)
