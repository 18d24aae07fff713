"""`edge build-engine` and `edge engines ls|verify|gc`: the offline build and the engine store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, JsonOpt, config_of
from edge.errors import EdgeError

__all__ = ["register"]

engines_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="The engine store: list, verify, garbage-collect.\n\nDocs: docs/models-and-engines.md")
StoreOpt = typer.Option(None, "--store", help="engine store (default: <cache_dir>/engines of the config)")


def _store(store: Optional[Path], config: Optional[str], existing: bool = True):  # -> EngineStore (lazy)
    """The store named by --store (a folder; one that is not there is an error where engines are
    read: a typo must not read as an empty store), else the config's (empty until a build)."""
    from edge.config import cache_dir
    from edge.engines.store import EngineStore

    if store is None:
        return EngineStore(cache_dir(config_of(config)) / "engines")
    if store.exists() and not store.is_dir():
        raise typer.BadParameter(f"{store} is not a folder; expected an engine store", param_hint="--store")
    if existing and not store.exists():
        raise typer.BadParameter(f"there is no engine store at {store}", param_hint="--store")
    return EngineStore(store)


def build_engine(recipe: Path = typer.Argument(..., help="engines/<model>.toml"),
                 backend: str = typer.Option("tensorrt", "--backend", help="tensorrt | onnxruntime"),
                 store: Optional[Path] = StoreOpt, config: Optional[str] = ConfigOpt) -> None:
    """Build an engine offline for this machine's key and put it in the store (atomically).

    Docs: docs/models-and-engines.md"""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from edge.device.identity import detect
    from edge.engines.build import build_engine as build
    from edge.engines.recipe import load_recipe

    r = load_recipe(recipe)
    st = _store(store, config, existing=False)  # a build makes it
    typer.echo(f"building {r.name} from {r.onnx} with {backend} into {st.root}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, step: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=max(total, 1))
            bar.update(tasks[phase], completed=step, total=max(total, 1))

        stored = build(r, backend, st, detect(), progress=progress, log=typer.echo)
    typer.echo(f"stored {stored.path} ({stored.bytes} bytes, sha256 {stored.sha256[:16]}…)")


@engines_app.command("ls")
def engines_ls(store: Optional[Path] = StoreOpt, config: Optional[str] = ConfigOpt,
               as_json: bool = JsonOpt) -> None:
    """Every engine in the store: key fields, size, created, builder.

    Docs: docs/models-and-engines.md"""
    from edge.engines.store import format_table

    entries = _store(store, config).entries()
    typer.echo(json.dumps([{"path": str(e.path), **e.meta} for e in entries], indent=2) if as_json
               else format_table(entries))


@engines_app.command("verify")
def engines_verify(store: Optional[Path] = StoreOpt, config: Optional[str] = ConfigOpt) -> None:
    """Check every engine's sha256 against its manifest; exit 1 if any is corrupt.

    Docs: docs/models-and-engines.md"""
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
               store: Optional[Path] = StoreOpt, config: Optional[str] = ConfigOpt) -> None:
    """Remove old engines (keeping the newest N per model and every one the config uses).

    Docs: docs/models-and-engines.md"""
    from edge.device.identity import detect
    from edge.engines.lookup import configured_engines

    cfg = config_of(config)
    # An engine with no match for this device has nothing to protect.
    in_use = {str(s.path) for _, s in configured_engines(cfg, detect()) if not isinstance(s, EdgeError)}
    for e in _store(store, config).gc(keep, in_use):
        typer.echo(f"removed {e.path}")


@engines_app.command("rekey")
def engines_rekey(store: Optional[Path] = StoreOpt, config: Optional[str] = ConfigOpt) -> None:
    """Key engines by this Jetson's module: those stored under the key of a board of this model
    (keys named the carrier board before they named the module), so they match every board
    that carries the same module.

    Docs: docs/models-and-engines.md"""
    from edge.device.identity import detect

    device = detect()
    if not device.jetson_module:
        raise EdgeError("edge engines rekey runs on a Jetson whose device tree names its module "
                        f"(/proc/device-tree/compatible); this device is {device.platform or device.cpu_arch}")
    st = _store(store, config)
    moved = 0
    for e in st.entries():
        if e.key.legacy_board and e.key.legacy_board == device.board:
            new = st.rekey(e, e.key.rekeyed(str(device.platform)))
            typer.echo(f"rekeyed {e.path.name} -> {new.path.name}")
            moved += 1
    typer.echo(f"{moved} engine(s) rekeyed to platform {device.platform} (board {device.board})")


def register(app: typer.Typer) -> None:
    app.command("build-engine")(build_engine)
    app.add_typer(engines_app, name="engines")
