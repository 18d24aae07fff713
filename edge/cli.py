"""The `edge` command. It only turns flags into a config and calls the modules that do the work;
every heavy import happens inside the command that needs it, so `edge --help` stays fast."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from edge.errors import EdgeError

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: importing rich costs ~90 ms per call
                  help="edge: cold-start runtime for Jetson-class devices.")

ConfigOpt = typer.Option(None, "--config", "-c", help="TOML config (default: $EDGE_CONFIG, "
                         "/etc/edge/edge.toml if present, else the embedded default model)")


@app.command()
def serve(config: Optional[Path] = ConfigOpt) -> None:
    """Load, lock and warm up the models, then serve on the inherited or configured socket."""
    from edge.timing import StartTimer

    timer = StartTimer()  # first: the report measures from exec, config parsing included
    from edge.config import find_config, load_config
    from edge.server import StoppedDuringStart, bind_sockets, serve as run
    from edge.systemd import listen_sockets, setup_logging

    with timer.phase("config"):
        cfg = load_config(find_config(str(config) if config else None))
    setup_logging(cfg.server.log_level)
    with timer.phase("sockets") as ph:
        sockets = listen_sockets()
        ph.detail["inherited"] = bool(sockets)
        if not sockets:
            try:
                sockets = bind_sockets(cfg.server)
            except OSError as exc:
                where = cfg.server.unix_socket or f"{cfg.server.host}:{cfg.server.port}"
                raise EdgeError(f"cannot listen on {where} (server table of {cfg.source}): "
                                f"{exc.strerror}") from None
    try:
        code = run(cfg, sockets, timer)
    except StoppedDuringStart:
        logging.getLogger("edge").info("stopped by SIGTERM before ready")
        code = 0
    raise typer.Exit(code)


@app.command()
def warmup(config: Optional[Path] = ConfigOpt,
           as_json: bool = typer.Option(False, "--json", help="print the report as JSON")) -> None:
    """Rehearse a start (page-in, load, lock, warm-up) without serving, and report each phase."""
    from edge.config import find_config, load_config
    from edge.server import rehearse
    from edge.systemd import setup_logging
    from edge.timing import StartTimer

    timer = StartTimer()
    cfg = load_config(find_config(str(config) if config else None))
    setup_logging(cfg.server.log_level)
    report = rehearse(cfg, timer)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@app.command()
def bench(url: str = typer.Option("http://127.0.0.1:8088", "--url", help="the running service"),
          requests: int = typer.Option(50, "--requests", min=1), concurrency: int = typer.Option(4, "--concurrency", min=1),
          prompt: str = typer.Option("Question: What is the capital of France?\nAnswer:", "--prompt"),
          max_tokens: int = typer.Option(16, "--max-tokens", min=1),
          model: Optional[str] = typer.Option(None, "--model")) -> None:
    """Latency and throughput of a running service (JSON): p50/p95/p99, requests/s, tokens/s."""
    from edge.bench import bench as run

    try:
        result = run(url, requests=requests, concurrency=concurrency, prompt=prompt, max_tokens=max_tokens,
                     model=model)
    except ValueError as exc:
        raise EdgeError(str(exc)) from None
    typer.echo(json.dumps(result, indent=2))
    if result["errors"]:
        raise typer.Exit(1)


@app.command()
def status(config: Optional[Path] = ConfigOpt,
           as_json: bool = typer.Option(False, "--json", help="print the report as JSON")) -> None:
    """Show the report of the last start: every phase with seconds, bytes and rates."""
    from edge.config import find_config, load_config, state_dir
    from edge.timing import REPORT_NAME, read_last_report

    cfg = load_config(find_config(str(config) if config else None))
    report = read_last_report(state_dir(cfg))
    if report is None:
        typer.echo(f"no start report yet in {state_dir(cfg) / REPORT_NAME}: has `edge serve` run?", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(format_report(report))


units_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="systemd units: print or install edge.socket + edge.service.")
app.add_typer(units_app, name="units")


def _unit_options(edge: Optional[str], config: str, listen: list[str], unix_socket: Optional[str],
                  socket_group: Optional[str], user: bool):
    from edge.units import UnitOptions, default_edge_command

    return UnitOptions(edge=edge or default_edge_command(), config=config,
                       listen=tuple(listen), unix_socket=unix_socket, socket_group=socket_group, user=user)


EdgeOpt = typer.Option(None, "--edge", help="absolute command for ExecStart (default: this edge)")
UnitConfigOpt = typer.Option("/etc/edge/edge.toml", "--config", help="config path the service reads")
ListenOpt = typer.Option(["127.0.0.1:8088"], "--listen", help="TCP address for ListenStream= (repeatable)")
UnixOpt = typer.Option(None, "--unix-socket", help="also listen on this Unix socket (mode 0660)")
GroupOpt = typer.Option(None, "--socket-group", help="group owning the Unix socket")
UserOpt = typer.Option(False, "--user", help="user units (systemctl --user), without privileged sandboxing")


@units_app.command("print")
def units_print(edge: Optional[str] = EdgeOpt, config: str = UnitConfigOpt, listen: list[str] = ListenOpt,
                unix_socket: Optional[str] = UnixOpt, socket_group: Optional[str] = GroupOpt,
                user: bool = UserOpt) -> None:
    """Print edge.socket and edge.service as they would be installed."""
    from edge.units import render_service, render_socket

    o = _unit_options(edge, config, listen, unix_socket, socket_group, user)
    typer.echo(f"# edge.socket\n{render_socket(o)}\n# edge.service\n{render_service(o)}")


@units_app.command("install")
def units_install(prefix: str = typer.Option("/", "--prefix", help="root to install under"),
                  edge: Optional[str] = EdgeOpt, config: str = UnitConfigOpt, listen: list[str] = ListenOpt,
                  unix_socket: Optional[str] = UnixOpt, socket_group: Optional[str] = GroupOpt,
                  user: bool = UserOpt) -> None:
    """Write edge.socket and edge.service (atomically) and say which systemctl commands to run."""
    from edge.units import install_starter_config, install_units, reclaim_config_dir

    o = _unit_options(edge, config, listen, unix_socket, socket_group, user)
    try:
        paths = install_units(o, prefix)
    except OSError as exc:
        raise EdgeError(f"cannot write units under {prefix}: {exc.strerror} ({exc.filename})") from None
    for p in paths:
        typer.echo(f"wrote {p}")
    cfg = Path(prefix) / o.config.lstrip("/")
    try:
        if reclaim_config_dir(cfg.parent):
            typer.echo(f"gave {cfg.parent} back to root (an older unit had handed it to the service)")
        written = install_starter_config(cfg)
    except OSError as exc:
        raise EdgeError(f"cannot write the starter config {cfg}: {exc.strerror}") from None
    typer.echo(f"wrote {cfg} (starter config: the embedded default model)" if written
               else f"kept {cfg} (already there)")
    ctl = "systemctl --user" if user else "systemctl"
    typer.echo(f"next:\n  {ctl} daemon-reload\n  {ctl} enable --now edge.socket edge.service\n"
               f"  (the service starts at boot so the model is warm before the first request)")


@app.command()
def doctor(config: Optional[Path] = ConfigOpt,
           as_json: bool = typer.Option(False, "--json", help="print the checks as JSON")) -> None:
    """Check config, model files, mlock limits, memory and units; explain each fix."""
    from edge.doctor import run_checks
    from edge.units import unit_dir

    dirs = [unit_dir("/", False), unit_dir("/", True)]
    checks = run_checks(str(config) if config else None, dirs)
    if as_json:
        typer.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        for c in checks:
            typer.echo(f"[{c.level.upper():>4}] {c.name}: {c.message}")
            if c.fix:
                typer.echo(f"       fix: {c.fix}")
    if any(c.level == "fail" for c in checks):
        raise typer.Exit(1)


engines_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="The engine store: list, verify, garbage-collect.")
app.add_typer(engines_app, name="engines")
StoreOpt = typer.Option(None, "--store", help="engine store (default: <cache_dir>/engines of the config)")


def _store(store: Optional[Path], config: Optional[Path]):
    from edge.config import cache_dir, find_config, load_config
    from edge.engines.store import EngineStore

    if store:
        return EngineStore(store)
    return EngineStore(cache_dir(load_config(find_config(str(config) if config else None))) / "engines")


@app.command()
def device(as_json: bool = typer.Option(False, "--json")) -> None:
    """What this machine is: Jetson module, L4T, SM arch, CUDA, TensorRT, ONNX Runtime."""
    from edge.device import detect

    info = detect().as_dict()
    typer.echo(json.dumps(info, indent=2) if as_json else
               "\n".join(f"{k:<14}{v if v is not None else '-'}" for k, v in info.items()))


@app.command("build-engine")
def build_engine_cmd(recipe: Path = typer.Argument(..., help="engines/<model>.toml"),
                     backend: str = typer.Option("tensorrt", "--backend", help="tensorrt | onnxruntime"),
                     store: Optional[Path] = StoreOpt, config: Optional[Path] = ConfigOpt) -> None:
    """Build an engine offline for this machine's key and put it in the store (atomically)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from edge.device import detect
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe

    r = load_recipe(recipe)
    st = _store(store, config)
    typer.echo(f"building {r.name} from {r.onnx} with {backend} into {st.root}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, step: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=max(total, 1))
            bar.update(tasks[phase], completed=step, total=max(total, 1))

        stored = build_engine(r, backend, st, detect(), progress=progress, log=typer.echo)
    typer.echo(f"stored {stored.path} ({stored.bytes} bytes, sha256 {stored.sha256[:16]}…)")


@engines_app.command("ls")
def engines_ls(store: Optional[Path] = StoreOpt, config: Optional[Path] = ConfigOpt,
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Every engine in the store: key fields, size, created, builder."""
    entries = _store(store, config).entries()
    if as_json:
        typer.echo(json.dumps([{"path": str(e.path), **e.meta} for e in entries], indent=2))
        return
    typer.echo(f"{'model':<16}{'backend':<13}{'target':<14}{'runtime':<22}{'prec':<6}{'MB':>8}  created  builder")
    for e in entries:
        k = e.key
        rt = f"cuda{k.cuda} trt{k.tensorrt}" if k.backend == "tensorrt" else f"ort{k.onnxruntime}"
        typer.echo(f"{k.model:<16}{k.backend:<13}{k.target:<14}{rt:<22}{k.precision:<6}"
                   f"{e.bytes / 1e6:>8.2f}  {e.meta.get('created')}  {e.meta.get('builder_host')}")


@engines_app.command("verify")
def engines_verify(store: Optional[Path] = StoreOpt, config: Optional[Path] = ConfigOpt) -> None:
    """Check every engine's sha256 against its manifest; exit 1 if any is corrupt."""
    bad, st = 0, _store(store, config)
    for e in st.entries():
        try:
            st.verify(e)
            typer.echo(f"ok       {e.path}")
        except EdgeError as exc:
            bad += 1
            typer.echo(f"CORRUPT  {exc}")
    if bad:
        raise typer.Exit(1)


@engines_app.command("gc")
def engines_gc(keep: int = typer.Option(2, "--keep", min=0, help="newest engines to keep per model"),
               store: Optional[Path] = StoreOpt, config: Optional[Path] = ConfigOpt) -> None:
    """Remove old engines (keeping the newest N per model and every one the config uses)."""
    from edge.config import find_config, load_config
    from edge.device import detect
    from edge.engines.serve import store_for, wanted_key

    cfg = load_config(find_config(str(config) if config else None))
    in_use, device_info = set(), detect()
    for e in cfg.engines:
        try:
            in_use.add(str(store_for(cfg, e).find(wanted_key(e, device_info)).path))
        except EdgeError:
            pass  # nothing for this device: nothing to protect
    for e in _store(store, config).gc(keep, in_use):
        typer.echo(f"removed {e.path}")


from edge.ota.cli import ota_app  # noqa: E402  (light: its commands import what they need)

app.add_typer(ota_app, name="ota")


def format_report(report: dict) -> str:
    lines = [f"last start: {report['started_at']}  pid {report['pid']}  host {report['host']}  "
             f"edge {report['edge_version']}",
             (f"rehearsal (nothing served): ready after {report['ready_s']:.3f} s"
              if report.get("rehearsal") else
              f"ready after {report['ready_s']:.3f} s on {', '.join(report.get('sockets', []))}"), "",
             f"{'phase':<19}{'start s':>9}{'seconds':>9}{'MB':>9}{'MB/s':>9}  detail"]
    for p in report["phases"]:
        mb = f"{p['bytes'] / 1e6:.1f}" if "bytes" in p else ""
        rate = f"{p['mb_per_s']:.0f}" if "mb_per_s" in p else ""
        detail = ", ".join(f"{k}={v}" for k, v in p["detail"].items() if not isinstance(v, (list, dict)))
        lines.append(f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}{mb:>9}{rate:>9}  {detail}")
    if report.get("warmup"):
        lines += ["", f"{'warm-up step':<19}{'seconds':>9}  what ran"]
        for w in report["warmup"]:
            lines.append(f"{w['name']:<19}{w['seconds']:>9.3f}  {w.get('model')}: {_warm_detail(w)}")
    return "\n".join(lines)


def _warm_detail(w: dict) -> str:
    if "output_shapes" in w:
        return f"outputs {w['output_shapes']}"
    if "events" in w:
        return f"{w['events']} streamed events"
    return f"{w.get('prompt_tokens')} prompt tokens, {w.get('completion_tokens')} generated"


def main() -> None:
    try:
        app()
    except EdgeError as exc:
        print(f"edge: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
