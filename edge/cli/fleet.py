"""`edge fleet rules|agent|dashboard`: what a fleet's Prometheus and Grafana need from edge: the
rules file to load, a Prometheus agent on the device that pushes its metrics out (no inbound
connection), and the dashboard with its provisioning file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from edge.cli.options import ConfigOpt, config_of, http_url, output_file

__all__ = ["register"]

fleet_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Fleet monitoring: Prometheus rules, a Prometheus agent that pushes, a Grafana dashboard."
                        "\n\nDocs: docs/fleet.md")


OutputOpt = typer.Option(None, "-o", "--output", callback=output_file,
                         help="write it to this file (atomically: a failed write leaves the old file) "
                              "instead of stdout")


def _emit(text: str, output: Optional[Path]) -> None:
    """stdout, or the --output file written atomically (edge.cli.output)."""
    from edge.cli.output import write_output

    if output is None:
        typer.echo(text, nl=False)
    else:
        write_output(output, text)


@fleet_app.command("rules")
def rules(output: Optional[Path] = OutputOpt) -> None:
    """Print the Prometheus rules shipped with edge (p50/p95 ready time by module and model;
    alerts: not ready, device silent, starts failing, crash loop, slow start, OTA rolled back, mlock not taken,
    model on the CPU, prompt-cache hit-rate collapse). Drop the output into the fleet Prometheus' rule_files.

    Docs: docs/fleet.md"""
    from edge.fleet.agent import rules_text

    _emit(rules_text(), output)


# A Prometheus duration: units from the largest down, each at most once (15s, 1m30s, 500ms).
_DURATION = re.compile(r"(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")


def _duration(value: str) -> str:
    if not _DURATION.fullmatch(value) or not any(c in "123456789" for c in value):
        raise typer.BadParameter(f"expected a Prometheus duration such as 15s or 1m30s, found {value!r}")
    return value


def _target(value: Optional[str]) -> Optional[str]:
    """host:port, [v6]:port: what Prometheus takes in static_configs (no scheme, no path)."""
    if value is None:
        return None
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})", value)
    if not m or not 0 < int(m[2]) < 65536:
        raise typer.BadParameter(f"expected host:port (an IPv6 address in brackets), found {value!r}")
    return value


def _config_target(config: Optional[str]) -> str:
    """The config's [server] address as a scrape target; an IPv6 host in brackets."""
    server = config_of(config).server
    if server.unix_socket:  # edge then listens on the socket only: nothing for the agent to reach
        raise typer.BadParameter(f"the config serves on the unix socket {server.unix_socket} only; "
                                 "Prometheus scrapes TCP: give --target (edge listening on TCP too)",
                                 param_hint="--target")
    host = f"[{server.host}]" if ":" in server.host else server.host
    return f"{host}:{server.port}"


AGENT_KEY_FILE = "/etc/edge/prometheus-agent.key"


def _scrape_access(config: Optional[str], target: str, ca_file: Optional[str], server_name: Optional[str],
                   key_file: Optional[str]) -> dict[str, Optional[str]]:
    """How the agent reaches this device's /metrics: over HTTPS trusting its certificate (the
    installed unit's edge-tls-cert credential, else tls_cert_file) checked by the name in it
    where the target's address is not; with a key where /metrics is keyed (keys configured and
    metrics_auth = "key"). Each flag given overrides what the device says."""
    from edge.fleet.agent import server_name_for
    from edge.host.doctor_auth import served_access
    from edge.host.units import installed_service, unit_dir

    cert, keyed = served_access(config_of(config), installed_service([unit_dir("/", False)]))
    ca = ca_file or (str(cert) if cert else None)
    if ca and server_name is None:
        try:
            server_name = server_name_for(Path(ca).read_bytes(), target.rsplit(":", 1)[0])
        except (OSError, ValueError) as exc:
            typer.echo(f"edge fleet agent: cannot read {ca} ({exc}): give --server-name if the certificate "
                       f"does not name {target.rsplit(':', 1)[0]}", err=True)
    return {"tls_ca": ca, "server_name": server_name if ca else None,
            "key_file": key_file or (AGENT_KEY_FILE if keyed else None)}


@fleet_app.command("agent")
def agent(remote_write: str = typer.Option(..., "--remote-write", callback=http_url,
                                           help="the fleet's remote-write URL"),
          instance: Optional[str] = typer.Option(None, "--instance", help="this device's name in the "
                                                 "fleet (default: its machine id, /etc/machine-id: "
                                                 "hostnames collide across a fleet)"),
          target: Optional[str] = typer.Option(None, "--target", callback=_target,
                                               help="edge's address to scrape, host:port "
                                               "(default: [server] host:port of the config)"),
          interval: str = typer.Option("15s", "--interval", callback=_duration,
                                       help="scrape interval (a Prometheus duration: 15s, 1m30s)"),
          unit: bool = typer.Option(False, "--unit", help="print the systemd unit instead of the config"),
          prometheus: str = typer.Option("/usr/bin/prometheus", "--prometheus",
                                         help="the Prometheus binary the unit runs (its version picks the agent flag)"),
          ca_file: Optional[str] = typer.Option(None, "--ca-file", help="scrape over HTTPS trusting this "
                                                "certificate (default: the one edge serves, when it serves TLS)"),
          server_name: Optional[str] = typer.Option(None, "--server-name", help="the name in edge's certificate "
                                                    "(default: its first DNS name, when the target's address is not in it)"),
          key_file: Optional[str] = typer.Option(None, "--key-file", help="a file holding one of edge's API keys, "
                                                 f"alone (default: {AGENT_KEY_FILE}, when edge's /metrics is keyed)"),
          config: Optional[str] = ConfigOpt, output: Optional[Path] = OutputOpt) -> None:
    """Print a Prometheus agent-mode config (or, with --unit, its systemd unit) that scrapes edge on
    this device and remote-writes to the fleet: devices behind NAT push, nothing connects to them.
    A device that serves TLS is scraped over HTTPS, one whose /metrics is keyed with a key: both
    passed to the agent's unit as systemd credentials.

    Docs: docs/fleet.md"""
    from edge.fleet.agent import AgentSetup, machine_id, prometheus_major

    if target is None:
        target = _config_target(config)
    setup = AgentSetup(remote_write=remote_write, instance=instance or machine_id(),
                       target=target, interval=interval, binary=prometheus,
                       **_scrape_access(config, target, ca_file, server_name, key_file))
    _emit(setup.unit(prometheus_major(prometheus)) if unit else setup.config(), output)


@fleet_app.command("dashboard")
def dashboard(provisioning: bool = typer.Option(False, "--provisioning", help="print Grafana's dashboard "
                                                "provider file instead (provisioning/dashboards/edge.yaml)"),
              path: str = typer.Option("/var/lib/grafana/dashboards/edge", "--path",
                                       help="with --provisioning: the folder that holds edge.json"),
              output: Optional[Path] = OutputOpt) -> None:
    """Print the fleet's Grafana dashboard (JSON; `edge fleet dashboard -o edge.json`): time to READY
    by module, model and edge version, starts by result, crashes, safe mode, OTA, mlock, devices not
    scraped, and every shipped alert's expression. Needs the `dashboard` extra (Python 3.11+).

    Docs: docs/fleet.md"""
    from edge.fleet.dashboard import dashboard_json, provisioning as provider

    _emit(provider(path) if provisioning else dashboard_json(), output)


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
