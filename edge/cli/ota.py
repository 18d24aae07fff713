"""`edge ota ...`: keygen, build (host), inspect, install, commit, rollback, recover, status, verify (device)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer

from edge.cli.options import a_file, a_folder, one_of, output_file
from edge.errors import EdgeError

ota_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                      help="Fleet updates: signed bundles, atomic install, health check, rollback.\n\nDocs: docs/ota.md")

ConfigOpt = typer.Option(None, "--config", "-c", help="the device's edge config (for state dir and health URL)")
PUBKEY = "an Ed25519 public key file (PEM, as `edge ota keygen` writes OUT.pub)"
PubOpt = typer.Option(None, "--pubkey", callback=lambda v: a_file(PUBKEY)(v),
                      help="Ed25519 public key that signs bundles (default: [ota] pubkey)")
# How a switch is activated and checked (install, rollback, recover): each defaults to [ota].
RestartCmdOpt = typer.Option(None, "--restart-cmd", help="instead of systemctl restart (default: [ota] restart_cmd)")
UnitOpt = typer.Option(None, "--unit", help="the service unit to restart or reload (default: [ota] unit, edge.service)")
HealthUrlOpt = typer.Option(None, "--health-url", help="polled until it answers 200 after the activation "
                            "(default: [ota] health_url, else the service's /readyz)")
TimeoutOpt = typer.Option(None, "--timeout", help="seconds the activated version may take to answer "
                          "--health-url (default: [ota] timeout_s)")
NoActivateOpt = typer.Option(False, "--no-activate", help="switch the links only: no restart or reload")


def _ota(config: Optional[Path], keep: Optional[int] = None, pubkey: Optional[Path] = None):
    """The device's OTA root; `pubkey` (default [ota] pubkey, where it is a file) checks an
    installed version's manifest before a rollback switches back to it."""
    from edge.config import find_config, load_config, state_dir
    from edge.ota.install import Ota

    # The OTA tree is read by the service's own user (the unit's DynamicUser=) whoever writes it:
    # root's `edge ota install`, or the drop-in's `ExecStartPre=+… recover` under the unit's
    # UMask=0077, which would leave a current/edge.toml the service cannot read (exit 78). It holds
    # no key, prompt or crash detail, and the state dir above it is the service's alone.
    os.umask(0o022)
    path = find_config(str(config) if config else None)
    cfg = load_config(path)
    key = pubkey or Path(cfg.ota.pubkey)
    return Ota(state_dir(cfg) / "ota", keep=keep or cfg.ota.keep_versions, config=path,
               pubkey=key if key.is_file() else None), cfg


def _controls(cfg: Any, unit: Optional[str]) -> list[tuple[Path, str]]:
    """Where the running service's control socket may be: from the config it serves (the OTA
    `current` link's), from its unit's StateDirectory=, from this config; in that order."""
    from edge.config import load_config, state_dir
    from edge.errors import EdgeError
    from edge.ota.activate import unit_state_dirs
    from edge.lifecycle.control import CONTROL_NAME, control_path

    found: list[tuple[Path, str]] = []
    serving = state_dir(cfg) / "ota" / "current" / "edge.toml"
    try:
        found.append((control_path(load_config(serving)), f"the state_dir of the served {serving}"))
    except EdgeError:
        pass  # no version or factory config is linked yet
    u = unit or cfg.ota.unit
    found += [(d / CONTROL_NAME, f"StateDirectory= of {u}") for d in unit_state_dirs(u)]
    found.append((control_path(cfg), "the state_dir of the installer's config"))
    return [(p, why) for i, (p, why) in enumerate(found) if p not in [q for q, _ in found[:i]]]


def _activator(cfg: Any, restart_cmd: Optional[str], unit: Optional[str], health_url: Optional[str],
               timeout: Optional[float], pid_file: Optional[Path] = None, log_file: Optional[Path] = None,
               reload: bool = False, control: Optional[Path] = None):
    """Flags first, then the config's [ota] table."""
    from edge.ota.activate import ReloadActivator, command_activator, systemd_activator

    o = cfg.ota
    if reload or control or (o.activation == "reload" and not restart_cmd):
        from edge.config import state_dir

        where = [(control, "--control")] if control else _controls(cfg, unit)
        return ReloadActivator(state_dir(cfg) / "ota" / "current" / "edge.toml", where, timeout or o.timeout_s)
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
ControlOpt = typer.Option(None, "--control", help="with --reload: the running service's control socket "
                          "(default: found from the served config, the unit, this config)")


def _echo(result: Any) -> None:
    _say(json.dumps(result, indent=2))


def _say(text: str) -> None:
    """The command's answer on stdout, after its work: an answer stdout cannot take is exit 74
    with the work standing (edge.cli.output, for every command)."""
    typer.echo(text)


def _new_key(value: Path) -> Path:
    """keygen -o: as any output file (checked before the key is made), and a key that is there
    already is never overwritten."""
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} exists; refusing to overwrite a key")
    return output_file(value)


def _version(value: str) -> str:
    from edge.ota.errors import VersionError
    from edge.ota.version import parse_version

    try:
        parse_version(value, "version")  # the installer's grammar (edge/ota/version.py)
    except VersionError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


STATUS_FIELDS = ["current", "previous", "pending", "highest"]


@ota_app.command()
def keygen(out: Path = typer.Option(Path("signing.key"), "-o", "--out", callback=_new_key,
                                    help="the private key to write (never overwritten); the public key: OUT.pub")) -> None:
    """Make an Ed25519 signing key (OUT, mode 0600) and its public key (OUT.pub).

    Docs: docs/ota.md"""
    from edge.ota.bundle import keygen as make

    try:
        pub = make(out)
    except FileExistsError:
        raise typer.BadParameter(f"{out} exists; refusing to overwrite a key",  # made meanwhile
                                 param_hint="'-o' / '--out'") from None
    except OSError as exc:
        raise EdgeError(f"{exc.filename or out}: cannot write the key: {exc.strerror or exc}") from None
    _say(f"wrote {out} (keep it secret) and {pub} (install it on devices as /etc/edge/ota.pub)")


def _bundle_files(model: list[Path], engines: Optional[Path],
                  recipe: list[Path]) -> list[tuple[Path, str, str, Any]]:
    """(source, path in bundle, kind, engine key) for every file the options name."""
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore

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
    return files


def _carries_what_config_names(config: Path):
    """The check inspect and install make (edge.ota.checks.check_bundle), made at build: a config
    that names a file the bundle does not list is refused here, not by every device later."""
    from edge.errors import ConfigError
    from edge.ota.checks import unlisted

    def check(bundle: Any) -> None:
        missing = unlisted(bundle)
        if missing:
            listed = ", ".join(f.path for f in bundle.files) or "no files"
            raise ConfigError(str(config), "", "its config references files the bundle does not carry (nor "
                              f"lists): {'; '.join(f'{field} = {path}' for field, _, path in missing)}; "
                              f"the bundle lists {listed}")
    return check


@ota_app.command()
def build(version: str = typer.Option(..., "--version", callback=_version,
                                      help="the bundle's version: MAJOR.MINOR.PATCH[-PRERELEASE]"),
          key: Path = typer.Option(..., "--key", callback=a_file("an Ed25519 signing key (edge ota keygen)"),
                                   help="the fleet's private signing key (edge ota keygen)"),
          config: Path = typer.Option(..., "--config", help="the config the devices run for this version"),
          model: list[Path] = typer.Option([], "--model", callback=a_file("a GGUF model file"),
                                           help="GGUF file -> models/<name> (repeatable)"),
          adapter: list[Path] = typer.Option([], "--adapter", callback=a_file("a GGUF LoRA adapter"),
                                             help="LoRA adapter file -> adapters/<name> (repeatable)"),
          engines: Optional[Path] = typer.Option(None, "--engines", callback=a_folder,
                                                 help="an engine store -> engines/"),
          recipe: list[Path] = typer.Option([], "--recipe", help="recipe + its ONNX -> recipes/ (repeatable)"),
          base: Optional[Path] = typer.Option(None, "--base",
                                              callback=a_file("an earlier bundle or its manifest.json"),
                                              help="an earlier bundle (or its manifest.json): "
                                              "a thin bundle that carries only the files it lacks"),
          out: Path = typer.Option(..., "-o", "--out", callback=output_file, help="the bundle to write (.edgeb)")) -> None:
    """Build a signed bundle (on the host); thin with --base.

    Docs: docs/ota.md"""
    from edge.config import read_config_text
    from edge.ota.bundle import build_bundle
    from edge.ota.manifest import read_base

    text = read_config_text(config)
    files = _bundle_files(model, engines, recipe) + [(a, f"adapters/{a.name}", "adapter", None) for a in adapter]
    try:
        manifest = build_bundle(out, version=version, files=files, config=text, key=key, source=str(config),
                                base=read_base(base) if base else None, check=_carries_what_config_names(config))
    except OSError as exc:
        raise EdgeError(f"{exc.filename or out}: cannot build the bundle: {exc.strerror or exc}") from None
    carried = [f for f in manifest["files"] if f.get("carried", True)]
    thin = f", thin on {manifest['base']['bundle_version']}: carries {len(carried)}" if base else ""
    _say(f"wrote {out}: version {version}, {len(manifest['files'])} files{thin}, "
               f"{out.stat().st_size} bytes")


FIELDS = {"version": lambda b: b.version, "content_digest": lambda b: b.content_digest,
          "base_version": lambda b: (b.base or {}).get("bundle_version", ""),
          "base_digest": lambda b: (b.base or {}).get("content_digest", "")}


@ota_app.command()
def inspect(bundle: Path, pubkey: Optional[Path] = typer.Option(None, "--pubkey", callback=lambda v: a_file(PUBKEY)(v),
                                                                 help="verify the signature with this public key "
                                                                 "(without it: checksums only)"),
            field: Optional[str] = typer.Option(None, "--field", callback=lambda v: one_of(v, list(FIELDS)),
                                                help="print one manifest field and stop: " + ", ".join(FIELDS))) -> None:
    """Print a bundle's manifest and verify its signature and every file's checksum, streaming:
    the checks install makes that do not depend on the device, with install's verdict.

    Docs: docs/ota.md"""
    from edge.ota.bundle import open_bundle
    from edge.ota.checks import check_bundle
    from edge.ota.errors import BundleError
    from edge.ota.extract import scan

    b = open_bundle(bundle, pubkey, insecure=pubkey is None)
    if field is not None:
        return _say(FIELDS[field](b))
    thin = f", thin on {b.base['bundle_version']} (content {b.base['content_digest'][:16]}…)" if b.base else ""
    lines = [f"bundle {bundle}: version {b.version}{thin}, created {b.manifest.get('created')}, "
             f"needs edge >= {b.manifest.get('min_edge_version')}, "
             f"signature {'verified with ' + str(pubkey) if pubkey else 'NOT checked (no --pubkey)'}"]
    check_bundle(b)
    bad = 0
    for f, problem in scan(b):
        bad += problem is not None
        key = f" for {f.key['target']}" if f.key else ""
        state = "ok " if problem is None else "BAD"
        state = "dev" if not f.carried else state  # a thin bundle's file the device must have
        lines.append(f"  {state} {f.kind:<7} {f.size:>12}  {f.path}{key}" + (f"  ({problem})" if problem else ""))
    lines.append("config:\n" + "\n".join("  " + line for line in b.manifest["config"].splitlines()))
    _say("\n".join(lines))
    if bad:  # the verdict is the exit code, also where stdout could not take the lines (not 74)
        raise BundleError(f"{bad} file(s) in {bundle} do not match the manifest")


@ota_app.command()
def install(bundle: Path, config: Optional[Path] = ConfigOpt, pubkey: Optional[Path] = PubOpt,
            insecure: bool = typer.Option(False, "--insecure", help="accept an unverified bundle"),
            restart_cmd: Optional[str] = RestartCmdOpt, unit: Optional[str] = UnitOpt,
            health_url: Optional[str] = HealthUrlOpt, timeout: Optional[float] = TimeoutOpt,
            no_activate: bool = typer.Option(False, "--no-activate", help="stage and switch only"),
            no_commit: bool = typer.Option(False, "--no-commit", help="activate and health-check, but "
                                           "leave it pending for `edge ota commit` (Mender's ArtifactCommit)"),
            allow_downgrade: bool = typer.Option(False, "--allow-downgrade", help="install a version older "
                                                 "than the highest this device committed"),
            pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt, reload: bool = ReloadOpt,
            control: Optional[Path] = ControlOpt,
            keep: Optional[int] = typer.Option(None, "--keep", min=2, help="versions kept on disk")) -> None:
    """Verify, check policy, stage, switch, restart, health-check; commit, or roll back on failure.

    Docs: docs/ota.md"""
    from edge.device.identity import detect
    from edge.errors import ConfigError
    from edge.ota.bundle import open_bundle

    ota, cfg = _ota(config, keep, pubkey)
    key = pubkey or Path(cfg.ota.pubkey)
    if not insecure and not key.is_file():
        raise ConfigError(cfg.source, "ota.pubkey", f"no bundle signing key at {key}: "
                          "install the fleet's public key there, pass --pubkey, or --insecure")
    b = open_bundle(bundle, None if insecure else key, insecure=insecure)
    act = None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout, pid_file, log_file,
                                              reload, control)
    result = ota.install(b, act, device=detect(), allow_downgrade=allow_downgrade, commit=not no_commit)
    _echo(result)
    if result["result"] == "rolled back":
        raise typer.Exit(1)


@ota_app.command()
def rollback(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = RestartCmdOpt,
             unit: Optional[str] = UnitOpt, health_url: Optional[str] = HealthUrlOpt,
             timeout: Optional[float] = TimeoutOpt,
             pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt,
             reload: bool = ReloadOpt, control: Optional[Path] = ControlOpt,
             no_activate: bool = NoActivateOpt, pubkey: Optional[Path] = PubOpt) -> None:
    """Undo a pending install, or switch back to the previous version (its files checked against
    its signed manifest first); restart (or reload).

    Docs: docs/ota.md"""
    ota, cfg = _ota(config, pubkey=pubkey)
    _echo(ota.rollback(None if no_activate else _activator(cfg, restart_cmd, unit, health_url, timeout,
                                                           pid_file, log_file, reload, control)))


@ota_app.command()
def commit(config: Optional[Path] = ConfigOpt) -> None:
    """Make the pending version permanent (after --no-activate or --no-commit).

    Docs: docs/ota.md"""
    _echo(_ota(config)[0].commit())


@ota_app.command()
def recover(config: Optional[Path] = ConfigOpt, restart_cmd: Optional[str] = RestartCmdOpt,
            unit: Optional[str] = UnitOpt, health_url: Optional[str] = HealthUrlOpt,
            timeout: Optional[float] = TimeoutOpt,
            pid_file: Optional[Path] = PidFileOpt, log_file: Optional[Path] = LogFileOpt,
            reload: bool = ReloadOpt, control: Optional[Path] = ControlOpt,
            boot: bool = typer.Option(False, "--boot", "--no-activate",
                                      help="at boot, before the service starts: no restart"),
            pubkey: Optional[Path] = PubOpt) -> None:
    """Converge what a killed command or a power cut left: an uncommitted version is rolled back
    (the version it goes back to checked against its signed manifest first), an interrupted repair
    is finished (and activated), links are made to agree with state.json (rebuilt if it is
    damaged), leftovers are deleted, old versions pruned. With --boot, the current version is
    checked as a boot can afford (sizes, sampled hashes, type, mode, links; in full after an
    interrupted repair) and repaired from the device's store, or the version before it is
    served. Needs no free space unless a file must be repaired.

    Docs: docs/ota.md"""
    ota, cfg = _ota(config, pubkey=pubkey)
    act = None if boot else _activator(cfg, restart_cmd, unit, health_url, timeout, pid_file, log_file,
                                       reload, control)
    rebuilt = ota.state().get("rebuilt")  # read-only: said here, written by recover
    result = ota.recover(act, boot=boot) or {"result": "nothing pending", "version": ota.state()["current"]}
    _echo({**result, **({"rebuilt": rebuilt} if rebuilt else {})})


@ota_app.command()
def status(config: Optional[Path] = ConfigOpt,
           field: Optional[str] = typer.Option(None, "--field", callback=lambda v: one_of(v, STATUS_FIELDS),
                                               help="print one field: current, previous, "
                                               "pending (its version) or highest; empty when none")) -> None:
    """Current, previous, pending and highest versions, links, versions on disk, history.

    Docs: docs/ota.md"""
    st = _ota(config)[0].status()
    if field is None:
        return _echo(st)
    value = st[field]["version"] if field == "pending" and st[field] else st[field]
    _say(value or "")


@ota_app.command()
def verify(config: Optional[Path] = ConfigOpt, pubkey: Optional[Path] = PubOpt) -> None:
    """Hash every file of every installed version again and compare it with the version's signed
    manifest (flash bit-rot). Exit 0 when all match, 65 naming every file that does not.

    Docs: docs/ota.md"""
    from edge.ota.errors import BundleError

    ota, cfg = _ota(config)
    key = pubkey or Path(cfg.ota.pubkey)
    report = ota.verify(key if key.is_file() else None)
    _echo(report)
    if report["problems"]:
        raise BundleError(f"{len(report['problems'])} installed file(s) do not match their signed manifest: "
                          + "; ".join(report["problems"]))
