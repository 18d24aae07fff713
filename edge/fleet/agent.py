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

A device that serves TLS is scraped over HTTPS trusting its own certificate (`tls_ca`, checked
against `server_name` when 127.0.0.1 is not a name in it); one whose /metrics is keyed (API keys
configured, `metrics_auth = "key"`, the default) with one of its keys (`key_file`, a file holding
that key alone). Both reach the agent as systemd credentials of its unit (`LoadCredential=`:
the files stay root's; the agent's DynamicUser reads its own copies under `CREDENTIALS`).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AgentSetup", "CREDENTIALS", "agent_flag", "machine_id", "prometheus_major", "rules_text", "server_name_for"]

RULES_FILE = "edge-rules.yml"
UNIT = "edge-prometheus-agent.service"
CREDENTIALS = f"/run/credentials/{UNIT}"  # where systemd puts the unit's LoadCredential= files
CA_CREDENTIAL, KEY_CREDENTIAL = "edge-tls-ca", "edge-api-key"
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


def server_name_for(cert_pem: bytes, host: str) -> str | None:
    """The name to verify the certificate by when it does not name `host` (the scrape target's
    address): its first DNS name; None when `host` is one of its names or it has no DNS name."""
    import ipaddress

    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = sans.get_values_for_type(x509.DNSName)
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None if host in dns else (dns[0] if dns else None)
    return None if ip in sans.get_values_for_type(x509.IPAddress) else (dns[0] if dns else None)


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
    tls_ca: str | None = None  # the certificate edge serves (or its CA): scraped over HTTPS trusting it
    server_name: str | None = None  # the name to check it by, where the target's address is not in it
    key_file: str | None = None  # a file holding one API key: the device's /metrics is keyed

    def config(self) -> str:
        return "\n".join([
            "# Prometheus agent for edge (`edge fleet agent`): scrape edge on this device, remote-write",
            "# to the fleet. Add basic_auth / authorization / tls_config under remote_write as needed.",
            "global:",
            f"  scrape_interval: {_q(self.interval)}",
            "scrape_configs:",
            f"  - job_name: {_q(self.job)}",
            *self._scrape_access(),
            "    static_configs:",
            f"      - targets: [{_q(self.target)}]",
            "    relabel_configs:",
            "      # every device scrapes 127.0.0.1: name the device instead, so the fleet tells them apart",
            "      - target_label: instance",
            f"        replacement: {_q(self.instance)}",
            "remote_write:",
            f"  - url: {_q(self.remote_write)}",
            ""])

    def _scrape_access(self) -> list[str]:
        """HTTPS trusting the device's certificate, and the key, read from the unit's credentials."""
        lines = []
        if self.tls_ca:
            lines += ["    scheme: https", "    tls_config:", f"      ca_file: {_q(f'{CREDENTIALS}/{CA_CREDENTIAL}')}"]
            lines += [f"      server_name: {_q(self.server_name)}"] if self.server_name else []
        if self.key_file:
            lines += ["    authorization:", "      type: Bearer",
                      f"      credentials_file: {_q(f'{CREDENTIALS}/{KEY_CREDENTIAL}')}"]
        return lines

    def _credentials(self) -> list[str]:
        return ([f"LoadCredential={CA_CREDENTIAL}:{self.tls_ca}"] if self.tls_ca else []) + \
               ([f"LoadCredential={KEY_CREDENTIAL}:{self.key_file}"] if self.key_file else [])

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
            *self._credentials(),
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
