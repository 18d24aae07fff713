"""Push instead of pull: a Prometheus in agent mode on the device scrapes edge over loopback and
remote-writes to the fleet's Prometheus (or Mimir/Thanos receive). Devices behind NAT need no
inbound connection; the agent's WAL holds samples while the uplink is down.

`edge fleet agent` prints the agent's config and its systemd unit; `edge fleet rules` the rules
file the receiving side loads (edge/fleet/rules/edge-rules.yml, package data). Every device scrapes
itself as 127.0.0.1, so the config sets `instance` to the device's name: the fleet tells devices
apart, and the rules join by (job, instance). The name defaults to the machine id
(/etc/machine-id, made once per installed system), not the hostname: devices flashed from one
image keep the image's hostname, and two devices under one `instance` are one flapping series.

The agent flag changed with Prometheus 3: `--enable-feature=agent` before, `--agent` since
(Debian 12 ships 2.42).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AgentSetup", "agent_flag", "machine_id", "prometheus_major", "rules_text"]

RULES_FILE = "edge-rules.yml"
MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def machine_id(files: tuple[Path, ...] = MACHINE_ID_FILES) -> str:
    """This system's machine id (systemd's, else D-Bus's: 32 hex digits); a usage error naming
    the files where there is none (an image not booted yet: `--instance` instead)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if re.fullmatch(r"[0-9a-f]{32}", text):
            return text
    from edge.errors import ConfigError

    raise ConfigError(" or ".join(str(p) for p in files), "", "no machine id (32 hex digits) to name this device "
                      "with: give --instance (a name unique in the fleet)")


def rules_text() -> str:
    """The rules file shipped in the wheel."""
    return (importlib.resources.files("edge.fleet") / "rules" / RULES_FILE).read_text(encoding="utf-8")


def prometheus_major(binary: str = "prometheus") -> int | None:
    """The major version of the installed Prometheus (`prometheus --version`); None if absent."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version (\d+)\.", out.stdout + out.stderr)
    return int(m.group(1)) if m else None


def agent_flag(major: int | None) -> str:
    return "--agent" if major is not None and major >= 3 else "--enable-feature=agent"


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar: every value escaped


@dataclass(frozen=True)
class AgentSetup:
    remote_write: str  # the fleet's receiver, e.g. https://prom.example.com/api/v1/write
    instance: str  # this device's name in the fleet
    target: str = "127.0.0.1:8088"  # edge's [server] address, scraped over loopback
    interval: str = "15s"
    job: str = "edge"
    binary: str = "/usr/bin/prometheus"
    config_path: str = "/etc/edge/prometheus-agent.yml"
    listen: str = "127.0.0.1:9095"  # the agent's own web/API port: loopback only

    def config(self) -> str:
        return "\n".join([
            "# Prometheus agent for edge (`edge fleet agent`): scrape edge on this device, remote-write",
            "# to the fleet. Add basic_auth / authorization / tls_config under remote_write as needed.",
            "global:",
            f"  scrape_interval: {_q(self.interval)}",
            "scrape_configs:",
            f"  - job_name: {_q(self.job)}",
            "    static_configs:",
            f"      - targets: [{_q(self.target)}]",
            "    relabel_configs:",
            "      # every device scrapes 127.0.0.1: name the device instead, so the fleet tells them apart",
            "      - target_label: instance",
            f"        replacement: {_q(self.instance)}",
            "remote_write:",
            f"  - url: {_q(self.remote_write)}",
            ""])

    def unit(self, major: int | None) -> str:
        return "\n".join([
            "# edge-prometheus-agent.service (`edge fleet agent --unit`): install into /etc/systemd/system",
            "[Unit]",
            "Description=Prometheus agent: scrapes edge on this device, remote-writes to the fleet",
            "Documentation=https://prometheus.io/docs/prometheus/latest/feature_flags/",
            "# edge.socket listens from early boot, so the agent can scrape as soon as it runs: while edge",
            "# starts, a scrape waits in the socket's backlog and times out (up=0 until READY).",
            "# No Requires=/BindsTo= edge.service: the agent keeps reporting while edge is down or restarts.",
            "After=network-online.target edge.socket",
            "Wants=network-online.target",
            "",
            "[Service]",
            f"ExecStart={self.binary} {agent_flag(major)} --config.file={self.config_path} "
            f"--storage.agent.path=/var/lib/edge-prometheus-agent --web.listen-address={self.listen}",
            "ExecReload=/bin/kill -HUP $MAINPID",
            "DynamicUser=yes",
            "StateDirectory=edge-prometheus-agent",
            "Restart=on-failure",
            "RestartSec=5",
            "ProtectSystem=strict",
            "ProtectHome=yes",
            "PrivateTmp=yes",
            "NoNewPrivileges=yes",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            ""])
