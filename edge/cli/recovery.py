"""`edge stop` (the unit's ExecStop=), `edge record-stop` (its ExecStopPost=) and `edge safe-mode`:
how the service's processes end, and the safe-mode steps that crashes made it take."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt

__all__ = ["register"]

safe_mode_app = typer.Typer(no_args_is_help=False, invoke_without_command=True, rich_markup_mode=None,
                            help="Safe mode: the fallbacks that crashes made the service take.\n\n"
                                 "Docs: docs/faults.md#native-faults-never-silent-never-a-crash-loop")


def stop(pid: Optional[int] = typer.Option(None, "--pid", help="the process to stop (default: $MAINPID, "
                                             "which systemd sets for ExecStop=)"),
         timeout: float = typer.Option(0.0, "--timeout", help="seconds to wait for it (0: until it is "
                                       "gone; under systemd, TimeoutStopSec= bounds it)")) -> None:
    """SIGTERM to the service's main process, then wait until it is gone: it stops accepting,
    drains its in-flight requests and exits. The unit's ExecStop=: after a handover the main
    process is not systemd's own child, and systemd (249-252) would not wait for it after its
    SIGTERM but kill it at once; systemd waits for ExecStop= instead.

    Docs: docs/deploy.md#the-units-in-detail"""
    if pid is None:
        raw = os.environ.get("MAINPID", "")
        if not raw and os.environ.get("SERVICE_RESULT"):
            return  # ExecStop= after the main process ended by itself (systemd sets no $MAINPID then)
        if not raw.isdigit() or int(raw) <= 1:
            typer.echo("edge stop: no process to stop: --pid not given and $MAINPID (set by systemd for "
                       f"ExecStop=) is {raw or 'not set'}", err=True)
            raise typer.Exit(2)
        pid = int(raw)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        t0 = time.monotonic()
        if not select.select([pidfd], [], [], timeout or None)[0]:
            typer.echo(f"edge stop: pid {pid} still runs {time.monotonic() - t0:.1f} s after SIGTERM", err=True)
            raise typer.Exit(1)
    except ProcessLookupError:
        return
    finally:
        os.close(pidfd)


def record_stop(config: Optional[str] = ConfigOpt) -> None:
    """Record how the service's main process ended, as systemd tells ExecStopPost= ($SERVICE_RESULT,
    $EXIT_CODE, $EXIT_STATUS): a crash keeps its signal even when the process could write nothing.
    Always exits 0 (it must never fail the unit's stop).

    Docs: docs/faults.md#native-faults-never-silent-never-a-crash-loop"""
    from edge.fleet.crashes import settle_all
    from edge.fleet.journal import Stop
    from edge.lifecycle.recovery import early_state_dir

    stop = Stop.from_env(dict(os.environ))
    try:
        folder = early_state_dir(config)
        written = settle_all(folder, stop if stop.result else None)
    except Exception as exc:  # never fail the unit's stop; say why once
        typer.echo(f"edge record-stop: could not record the stop: {type(exc).__name__}: {exc}", err=True)
        return
    for path in written:
        report = json.loads(path.read_text())
        typer.echo(f"edge: pid {report.get('pid')} {report.get('result')}: {report.get('error')}", err=True)


@safe_mode_app.callback()
def show(ctx: typer.Context, config: Optional[str] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """The safe-mode steps in force (and the crashes counted), or `clear` to end safe mode.

    Docs: docs/faults.md#native-faults-never-silent-never-a-crash-loop"""
    if ctx.invoked_subcommand is not None:
        return
    from edge.fleet.crashes import recent_crashes
    from edge.lifecycle.recovery import early_state_dir
    from edge.lifecycle.safemode import SafeMode

    from edge.fleet.giveup import GiveUp

    folder = early_state_dir(config)
    mode = SafeMode.load(folder)
    give_up = GiveUp.load(folder)
    if as_json:
        typer.echo(json.dumps({"state_dir": str(folder), "safe_mode": mode.describe(),
                               "given_up": give_up.as_dict() if give_up else None,
                               "crashes": recent_crashes(folder)}, indent=2))
        return
    if give_up is not None:
        typer.echo(f"GIVEN UP since {give_up.as_dict()['since']}: {give_up.reason} (retry at "
                   f"{give_up.as_dict()['retry_at']}{', being retried' if give_up.retrying else ''})")
    if not mode.fallbacks:
        typer.echo(f"safe mode: no step in force ({folder})" if give_up else f"safe mode: off ({folder})")
    for step in mode.describe():
        typer.echo(f"SAFE MODE {step['target']}: {step['fallback']} since {step['since']} "
                   f"({step['reason']})")


@safe_mode_app.command()
def clear(config: Optional[str] = ConfigOpt) -> None:
    """End safe mode: the next start takes the full path again, and the crashes so far are counted
    no more. A give-up ends too: the process answering 503 exits at once, and the next client (or
    one waiting) starts the service, with no systemctl command.

    Docs: docs/faults.md#native-faults-never-silent-never-a-crash-loop"""
    from edge.fleet.giveup import GiveUp
    from edge.lifecycle.recovery import early_state_dir
    from edge.lifecycle.safemode import SafeMode

    from edge.errors import EdgeError

    folder = early_state_dir(config)
    if not folder.is_dir():  # no start ever used it: nothing is in force
        typer.echo(f"safe mode cleared in {folder} (it was off: no state dir there yet)")
        return
    mode = SafeMode.load(folder)
    steps = mode.describe()
    try:
        mode.clear()
        gave_up = GiveUp.remove(folder)
    except OSError as exc:
        raise EdgeError(f"{exc.filename or folder}: cannot end safe mode: {exc.strerror or exc}") from None
    typer.echo(f"safe mode cleared in {folder}" + (": " + "; ".join(f"{s['target']}: {s['fallback']}"
                                                                   for s in steps) if steps else " (it was off)")
               + ("; the give-up ended" if gave_up else ""))


def register(app: typer.Typer) -> None:
    app.command(name="stop")(stop)
    app.command(name="record-stop")(record_stop)
    app.add_typer(safe_mode_app, name="safe-mode")
