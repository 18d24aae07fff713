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
               timeout: Optional[float]):
    """Flags first, then the config's [ota] table."""
    from edge.ota.install import command_activator, systemd_activator

    o = cfg.ota
    url = health_url or o.health_url or f"http://{cfg.server.host}:{cfg.server.port}/readyz"
    cmd, wait = restart_cmd or o.restart_cmd, timeout or o.timeout_s
    if cmd:
        return command_activator(cmd, url, wait)
    return systemd_activator(unit or o.unit, url, wait)


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
    """Print a bundle's manifest and verify its signature (and every file's checksum)."""
    import hashlib
    import tarfile

    from edge.ota.bundle import open_bundle

    b = open_bundle(bundle, pubkey, insecure=pubkey is None)
    typer.echo(f"bundle {bundle}: version {b.version}, created {b.manifest.get('created')}, "
               f"signature {'verified with ' + str(pubkey) if pubkey else 'NOT checked (no --pubkey)'}")
    sums = {}
    with tarfile.open(bundle, "r:") as tar:
        for m in tar:
            if m.isfile() and m.name.startswith("files/"):
                sums[m.name[6:]] = hashlib.sha256(tar.extractfile(m).read()).hexdigest()  # type: ignore[union-attr]
    bad = 0
    for f in b.files:
        ok = sums.get(f.path) == f.sha256
        bad += not ok
        key = f" for {f.key['target']}" if f.key else ""
        typer.echo(f"  {'ok ' if ok else 'BAD'} {f.kind:<7} {f.size:>12}  {f.path}{key}")
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
            keep: Optional[int] = typer.Option(None, "--keep", min=2, help="versions kept on disk")) -> None:
    """Verify, stage, switch, restart, health-check; commit, or roll back on failure."""
    from edge.device import detect
    from edge.ota.bundle import open_bundle

    ota, cfg = _ota(config, keep)
    key = pubkey or Path(cfg.ota.pubkey)
    if not insecure and not key.is_file():
        raise EdgeError(f"no bundle signing key at {key}: install the fleet's public key there "
                        "([ota] pubkey in the config), pass --pubkey, or --insecure")
    b = open_bundle(bundle, None if insecure else key, insecure=insecure)
    act = None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout)
    result = ota.install(b, act, device=detect())
    _echo(result)
    if result["result"] == "rolled back":
        raise typer.Exit(1)


@ota_app.command()
def rollback(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = typer.Option(None, "--restart-cmd"),
             unit: Optional[str] = typer.Option(None, "--unit"), health_url: Optional[str] = typer.Option(None, "--health-url"),
             timeout: Optional[float] = typer.Option(None, "--timeout"),
             no_activate: bool = typer.Option(False, "--no-activate")) -> None:
    """Switch back to the previous version and restart."""
    ota, cfg = _ota(config)
    _echo(ota.rollback(None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout)))


@ota_app.command()
def commit(config: Optional[Path] = ConfigOpt) -> None:
    """Mark the current version good (after an install with --no-activate)."""
    _echo(_ota(config)[0].commit())


@ota_app.command()
def recover(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = typer.Option(None, "--restart-cmd"),
            unit: Optional[str] = typer.Option(None, "--unit"), health_url: Optional[str] = typer.Option(None, "--health-url"),
            timeout: Optional[float] = typer.Option(None, "--timeout")) -> None:
    """Finish what a killed install left: health-check a pending switch, then commit or roll back."""
    ota, cfg = _ota(config)
    _echo(ota.recover(_activator(cfg, restart_cmd, unit, health_url, timeout)) or {"result": "nothing pending"})


@ota_app.command()
def status(config: Optional[Path] = ConfigOpt) -> None:
    """Current, previous and pending versions, and the history with reasons."""
    ota, _ = _ota(config)
    st = ota.state()
    st["current_link"], st["previous_link"] = ota.link_target("current"), ota.link_target("previous")
    st["on_disk"] = sorted(d.name for d in ota.versions.glob("*") if (d / ".complete").is_file()) \
        if ota.versions.exists() else []
    _echo(st)
