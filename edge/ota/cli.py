"""`edge ota ...`: keygen, build (host), inspect, install, commit, rollback, recover, status (device)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from edge.errors import EdgeError

ota_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                      help="Fleet updates: signed bundles, atomic install, health check, rollback.")

ConfigOpt = typer.Option(None, "--config", "-c", help="the device's edge config (for state dir and health URL)")
PubOpt = typer.Option(None, "--pubkey", help="Ed25519 public key that signs bundles (default: [ota] pubkey)")


def _ota(config: Optional[Path], keep: Optional[int] = None):
    from edge.config import find_config, load_config, state_dir
    from edge.ota.install import Ota

    cfg = load_config(find_config(str(config) if config else None))
    return Ota(state_dir(cfg) / "ota", keep=keep or cfg.ota.keep_versions), cfg


def _activator(cfg: Any, restart_cmd: Optional[str], unit: Optional[str], health_url: Optional[str],
               timeout: Optional[float], pid_file: Optional[Path] = None, log_file: Optional[Path] = None,
               reload: bool = False):
    """Flags first, then the config's [ota] table."""
    from edge.ota.activate import ReloadActivator, command_activator, systemd_activator

    o = cfg.ota
    if reload or (o.activation == "reload" and not restart_cmd):
        from edge.config import state_dir
        from edge.control import control_path

        return ReloadActivator(state_dir(cfg) / "ota" / "current" / "edge.toml", control_path(cfg),
                               timeout or o.timeout_s)
    url = health_url or o.health_url or f"http://{cfg.server.host}:{cfg.server.port}/readyz"
    cmd, wait = restart_cmd or o.restart_cmd, timeout or o.timeout_s
    if cmd:
        return command_activator(cmd, url, wait, pid_file, log_file)
    return systemd_activator(unit or o.unit, url, wait)


PidFileOpt = typer.Option(None, "--pid-file", help="with --restart-cmd: the service's pid file (an "
                          "exited service fails the health check at once)")
ReloadOpt = typer.Option(False, "--reload", help="activate by a zero-gap reload of the running "
                         "service instead of a restart ([ota] activation = \"reload\")")
LogFileOpt = typer.Option(None, "--log-file", help="with --pid-file: the service's output (its last "
                          "lines become the rollback reason)")


def _echo(result: Any) -> None:
    typer.echo(json.dumps(result, indent=2))


@ota_app.command()
def keygen(out: Path = typer.Option(Path("signing.key"), "-o", "--out")) -> None:
    """Make an Ed25519 signing key (OUT, mode 0600) and its public key (OUT.pub)."""
    from edge.ota.bundle import keygen as make

    try:
        pub = make(out)
    except FileExistsError:
        raise EdgeError(f"{out} exists: refusing to overwrite a signing key") from None
    typer.echo(f"wrote {out} (keep it secret) and {pub} (install it on devices as /etc/edge/ota.pub)")


@ota_app.command()
def build(version: str = typer.Option(..., "--version"), key: Path = typer.Option(..., "--key"),
          config: Path = typer.Option(..., "--config", help="the config the devices run for this version"),
          model: list[Path] = typer.Option([], "--model", help="GGUF file -> models/<name> (repeatable)"),
          engines: Optional[Path] = typer.Option(None, "--engines", help="an engine store -> engines/"),
          recipe: list[Path] = typer.Option([], "--recipe", help="recipe + its ONNX -> recipes/ (repeatable)"),
          out: Path = typer.Option(..., "-o", "--out")) -> None:
    """Build a signed bundle (on the host)."""
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore
    from edge.ota.bundle import build_bundle

    files: list[tuple[Path, str, str, Any]] = [(m, f"models/{m.name}", "model", None) for m in model]
    if engines:
        store = EngineStore(engines)
        for e in store.entries():
            rel = e.path.relative_to(store.root)
            files.append((e.path, f"engines/{rel}", "engine", e.key.as_dict()))
        for man in sorted(store.root.glob("*/*/manifest.json")):
            files.append((man, f"engines/{man.relative_to(store.root)}", "other", None))
    for r in recipe:
        rec = load_recipe(r)
        files += [(r, f"recipes/{r.name}", "recipe", None), (Path(rec.onnx), f"recipes/{Path(rec.onnx).name}", "recipe", None)]
    for src, _, _, _ in files:
        if not src.is_file():
            raise EdgeError(f"{src}: no such file to put in the bundle")
    manifest = build_bundle(out, version=version, files=files, config=config.read_text(), key=key)
    typer.echo(f"wrote {out}: version {version}, {len(manifest['files'])} files")


@ota_app.command()
def inspect(bundle: Path, pubkey: Optional[Path] = typer.Option(None, "--pubkey")) -> None:
    """Print a bundle's manifest and verify its signature (and every file's checksum, streaming)."""
    from edge.ota.bundle import open_bundle
    from edge.ota.extract import scan

    b = open_bundle(bundle, pubkey, insecure=pubkey is None)
    typer.echo(f"bundle {bundle}: version {b.version}, created {b.manifest.get('created')}, "
               f"needs edge >= {b.manifest.get('min_edge_version')}, "
               f"signature {'verified with ' + str(pubkey) if pubkey else 'NOT checked (no --pubkey)'}")
    bad = 0
    for f, problem in scan(b):
        bad += problem is not None
        key = f" for {f.key['target']}" if f.key else ""
        typer.echo(f"  {'ok ' if problem is None else 'BAD'} {f.kind:<7} {f.size:>12}  {f.path}{key}"
                   + (f"  ({problem})" if problem else ""))
    typer.echo("config:\n" + "\n".join("  " + line for line in b.manifest["config"].splitlines()))
    if bad:
        raise EdgeError(f"{bad} file(s) in {bundle} do not match the manifest")


@ota_app.command()
def install(bundle: Path, config: Optional[Path] = ConfigOpt, pubkey: Optional[Path] = PubOpt,
            insecure: bool = typer.Option(False, "--insecure", help="accept an unverified bundle"),
            restart_cmd: Optional[str] = typer.Option(None, "--restart-cmd", help="instead of systemctl restart"),
            unit: Optional[str] = typer.Option(None, "--unit"),
            health_url: Optional[str] = typer.Option(None, "--health-url"),
            timeout: Optional[float] = typer.Option(None, "--timeout"),
            no_activate: bool = typer.Option(False, "--no-activate", help="stage and switch only"),
            no_commit: bool = typer.Option(False, "--no-commit", help="activate and health-check, but "
                                           "leave it pending for `edge ota commit` (Mender's ArtifactCommit)"),
            allow_downgrade: bool = typer.Option(False, "--allow-downgrade", help="install a version older "
                                                 "than the highest this device committed"),
            pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt, reload: bool = ReloadOpt,
            keep: Optional[int] = typer.Option(None, "--keep", min=2, help="versions kept on disk")) -> None:
    """Verify, check policy, stage, switch, restart, health-check; commit, or roll back on failure."""
    from edge.device import detect
    from edge.ota.bundle import open_bundle

    ota, cfg = _ota(config, keep)
    key = pubkey or Path(cfg.ota.pubkey)
    if not insecure and not key.is_file():
        raise EdgeError(f"no bundle signing key at {key}: install the fleet's public key there "
                        "([ota] pubkey in the config), pass --pubkey, or --insecure")
    b = open_bundle(bundle, None if insecure else key, insecure=insecure)
    act = None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout, pid_file, log_file,
                                              reload)
    result = ota.install(b, act, device=detect(), allow_downgrade=allow_downgrade, commit=not no_commit)
    _echo(result)
    if result["result"] == "rolled back":
        raise typer.Exit(1)


@ota_app.command()
def rollback(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = typer.Option(None, "--restart-cmd"),
             unit: Optional[str] = typer.Option(None, "--unit"), health_url: Optional[str] = typer.Option(None, "--health-url"),
             timeout: Optional[float] = typer.Option(None, "--timeout"),
             pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt,
             no_activate: bool = typer.Option(False, "--no-activate")) -> None:
    """Undo a pending install, or switch back to the previous version; restart."""
    ota, cfg = _ota(config)
    _echo(ota.rollback(None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout,
                                                           pid_file, log_file)))


@ota_app.command()
def commit(config: Optional[Path] = ConfigOpt) -> None:
    """Make the pending version permanent (after --no-activate or --no-commit)."""
    _echo(_ota(config)[0].commit())


@ota_app.command()
def recover(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = typer.Option(None, "--restart-cmd"),
            unit: Optional[str] = typer.Option(None, "--unit"), health_url: Optional[str] = typer.Option(None, "--health-url"),
            timeout: Optional[float] = typer.Option(None, "--timeout"),
            pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt,
            boot: bool = typer.Option(False, "--boot", "--no-activate",
                                      help="at boot, before the service starts: no restart")) -> None:
    """Converge what a killed command or a power cut left: an uncommitted version is rolled back,
    links are made to agree with state.json, leftovers are deleted, old versions pruned."""
    ota, cfg = _ota(config)
    act = None if boot else _activator(cfg, restart_cmd, unit, health_url, timeout, pid_file, log_file)
    _echo(ota.recover(act) or {"result": "nothing pending", "version": ota.state()["current"]})


@ota_app.command()
def status(config: Optional[Path] = ConfigOpt,
           field: Optional[str] = typer.Option(None, "--field", help="print one field: current, previous, "
                                               "pending (its version) or highest; empty when none")) -> None:
    """Current, previous, pending and highest versions, links, versions on disk, history."""
    st = _ota(config)[0].status()
    if field is None:
        return _echo(st)
    if field not in ("current", "previous", "pending", "highest"):
        raise EdgeError(f"--field {field!r}: expected current, previous, pending or highest")
    value = st[field]["version"] if field == "pending" and st[field] else st[field]
    typer.echo(value or "")
