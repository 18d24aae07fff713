"""`edge units print|install`: render edge.socket + edge.service for this installation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edge.config import DEFAULT_LISTEN, SYSTEM_CONFIG
from edge.errors import EdgeError

__all__ = ["register"]

units_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="systemd units: print or install edge.socket + edge.service.\n\nDocs: docs/deploy.md#3-the-units-and-a-starter-config")

def _absolute(value: Optional[str]) -> Optional[str]:
    if value is not None and not value.startswith("/"):
        raise typer.BadParameter(f"expected an absolute path (systemd needs one), found {value!r}")
    return value


def _listen(values: list[str]) -> list[str]:
    """ListenStream= addresses: PORT, HOST:PORT or [V6]:PORT, the host an IP address."""
    import ipaddress

    for v in values:
        host, _, port = v.rpartition(":")
        try:
            if host:
                ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
            ok = port.isdigit() and 1 <= int(port) <= 65535
        except ValueError:
            ok = False
        if not ok:
            raise typer.BadParameter(f"expected PORT, ADDRESS:PORT or [IPV6]:PORT (a port 1-65535), found {v!r}")
    return values


def _prefix(value: str) -> str:
    if not Path(value).is_dir():
        raise typer.BadParameter(f"{value} is not an existing directory")
    return value


EdgeOpt = typer.Option(None, "--edge", callback=_absolute, help="absolute command for ExecStart (default: this edge)")
UnitConfigOpt = typer.Option(str(SYSTEM_CONFIG), "--config", help="config path the service reads")
ListenOpt = typer.Option([DEFAULT_LISTEN], "--listen", callback=_listen, help="TCP address for ListenStream= (repeatable)")
UnixOpt = typer.Option(None, "--unix-socket", callback=_absolute, help="also listen on this Unix socket (mode 0660)")
GroupOpt = typer.Option(None, "--socket-group", help="group owning the Unix socket")
UserOpt = typer.Option(False, "--user", help="user units (systemctl --user), without privileged sandboxing")
RootOpt = typer.Option("/", "--root", help="the device's root tree: its GPU platform decides DeviceAllow=")


def _options(edge: Optional[str], config: str, listen: list[str], unix_socket: Optional[str],
             socket_group: Optional[str], user: bool, root: str):  # -> edge.host.units.UnitOptions (lazy import)
    from edge.host.gpu_nodes import platform_policy
    from edge.host.units import UnitOptions, default_edge_command

    policy = platform_policy(root)
    return UnitOptions(edge=edge or default_edge_command(), config=config, listen=tuple(listen),
                       unix_socket=unix_socket, socket_group=socket_group, user=user, devices=policy.devices,
                       modprobe=policy.modprobe)


@units_app.command("print")
def units_print(edge: Optional[str] = EdgeOpt, config: str = UnitConfigOpt, listen: list[str] = ListenOpt,
                unix_socket: Optional[str] = UnixOpt, socket_group: Optional[str] = GroupOpt,
                user: bool = UserOpt, root: str = RootOpt) -> None:
    """Print edge.socket and edge.service (and edge-nvidia-uvm.service where nvidia-modprobe is) as
    they would be installed on the device at --root.

    Docs: docs/deploy.md#the-units-in-detail"""
    from edge.host.gpu_nodes import UVM_UNIT, nvidia_minors, render_uvm
    from edge.host.units import render_service, render_socket

    o = _options(edge, config, listen, unix_socket, socket_group, user, root)
    typer.echo(f"# edge.socket\n{render_socket(o)}\n# edge.service\n{render_service(o)}")
    if o.modprobe and not o.user:
        typer.echo(f"\n# {UVM_UNIT}\n{render_uvm(o.modprobe, nvidia_minors(o.devices))}")


@units_app.command("install")
def units_install(prefix: str = typer.Option("/", "--prefix", callback=_prefix, help="root to install under"),
                  edge: Optional[str] = EdgeOpt, config: str = UnitConfigOpt, listen: list[str] = ListenOpt,
                  unix_socket: Optional[str] = UnixOpt, socket_group: Optional[str] = GroupOpt,
                  user: bool = UserOpt) -> None:
    """Write edge.socket and edge.service (atomically) and say which systemctl commands to run;
    the GPU device policy is that of the device at --prefix.

    Docs: docs/deploy.md#3-the-units-and-a-starter-config"""
    from edge.host.units import install_starter_config, install_units, reclaim_config_dir, starter_path

    o = _options(edge, config, listen, unix_socket, socket_group, user, prefix)
    try:
        paths = install_units(o, prefix)
    except OSError as exc:
        raise EdgeError(f"cannot write units under {prefix}: {exc.strerror} ({exc.filename})") from None
    for p in paths:
        typer.echo(f"wrote {p}")
    cfg = Path(prefix) / starter_path(o.config).lstrip("/")
    if starter_path(o.config) != o.config:
        typer.echo(f"the units serve the OTA-managed {o.config}: `edge ota recover` (the drop-in's, at the "
                   f"next start) points it at the factory config {starter_path(o.config)} until a version "
                   "is installed (docs/ota.md)")
    try:
        if reclaim_config_dir(cfg.parent):
            typer.echo(f"gave {cfg.parent} back to root (an older unit had handed it to the service)")
        written = install_starter_config(cfg)
    except OSError as exc:
        raise EdgeError(f"cannot write the starter config {cfg}: {exc.strerror}") from None
    typer.echo(f"wrote {cfg} (starter config: the embedded default model)" if written
               else f"kept {cfg} (already there)")
    _compile(o.edge, prefix)
    ctl = "systemctl --user" if user else "systemctl"
    typer.echo(f"next:\n  {ctl} daemon-reload\n  {ctl} enable --now edge.socket edge.service\n"
               f"  (the service starts at boot so the model is warm before the first request)")


def _compile(edge: str, prefix: str) -> None:
    """Bytecode for this edge and its dependencies, written now: the unit can never write it
    (ProtectSystem=strict), so whatever is missing would be compiled at every start."""
    from edge.host.units import default_edge_command
    from edge.bytecode import compile_missing, dependency_sources, edge_package, package_sources

    pkg = edge_package()
    if prefix != "/" or edge != default_edge_command():
        typer.echo(f"bytecode: not compiled here (the unit runs {edge}{' under ' + prefix if prefix != '/' else ''}, "
                   f"not this edge): run `edge units install` with that edge, or `python -m compileall -q "
                   f"--invalidation-mode checked-hash <its edge package>`", err=True)
        return
    failed = compile_missing(package_sources(pkg)) + compile_missing(dependency_sources(), checked_hash=False)
    if failed:
        path, why = failed[0]
        typer.echo(f"edge: warning: {len(failed)} modules are left without bytecode ({path}: {why}): every "
                   f"start compiles them; run `edge units install` as the owner of {path.parent}", err=True)
    else:
        typer.echo(f"bytecode: {pkg} (checked-hash) and edge's dependencies compiled")


def register(app: typer.Typer) -> None:
    app.add_typer(units_app, name="units")
