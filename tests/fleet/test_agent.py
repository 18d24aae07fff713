"""Push without inbound connections: the real Prometheus (Debian's package) in agent mode scrapes a
real `edge serve` over loopback and remote-writes to a second, real Prometheus with its
remote-write receiver on; the receiver then answers PromQL about the device. The printed config
passes `promtool check config --agent`, the unit `systemd-analyze verify`."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
from pathlib import Path

import httpx
import pytest

from kit import EDGE
from edge.fleet.agent import AgentSetup, agent_flag, prometheus_major
from kit.prom import Prometheus, need, until


def _edge(*args: str) -> str:
    r = subprocess.run([*EDGE, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_printed_agent_config_passes_promtool(tmp_path: Path) -> None:
    promtool = need("promtool")
    text = _edge("fleet", "agent", "--remote-write", "https://fleet.example/api/v1/write",
                 "--instance", 'dev "7"', "--target", "127.0.0.1:9999")
    (tmp_path / "agent.yml").write_text(text)
    r = subprocess.run([promtool, "check", "config", "--agent", str(tmp_path / "agent.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'replacement: "dev \\"7\\""' in text  # escaped, not broken, by a name with quotes


def test_the_target_comes_from_the_config_as_prometheus_takes_it(tmp_path: Path, tiny_gguf: Path) -> None:
    from kit import write_config

    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    text = cfg.read_text()
    v6 = tmp_path / "v6.toml"
    v6.write_text(text.replace('host = "127.0.0.1"', 'host = "::1"', 1))
    assert "targets: [\"[::1]:" in _edge("fleet", "agent", "--remote-write", "https://f/api/v1/write",
                                          "--config", str(v6))
    unix = tmp_path / "unix.toml"  # edge then listens on the socket only: nothing to scrape
    unix.write_text(text.replace("[server]\n", f'[server]\nunix_socket = "{tmp_path}/e.sock"\n', 1))
    for args in (["--config", str(unix)], ["--target", "http://x/metrics"], ["--target", "x:99999"]):
        r = subprocess.run([*EDGE, "fleet", "agent", "--remote-write", "https://f/api/v1/write", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Invalid value for --target" in r.stderr.replace("'", ""), r.stderr
    assert "targets: [\"[fe80::1]:8088\"]" in _edge("fleet", "agent", "--remote-write", "https://f/api/v1/write",
                                                    "--target", "[fe80::1]:8088")


def test_the_instance_defaults_to_the_machine_id_not_the_hostname(tmp_path: Path) -> None:
    """Devices flashed from one image share its hostname: the machine id names each one."""
    from edge.errors import ConfigError
    from edge.fleet.agent import machine_id

    text = _edge("fleet", "agent", "--remote-write", "https://f/api/v1/write", "--target", "127.0.0.1:8088")
    mine = Path("/etc/machine-id").read_text().strip()
    assert f'replacement: "{mine}"' in text and len(mine) == 32
    systemd, dbus = tmp_path / "machine-id", tmp_path / "dbus-machine-id"
    systemd.write_text("\n")  # an image not booted yet: systemd's is empty, D-Bus's is there
    dbus.write_text("0123456789abcdef0123456789abcdef\n")
    assert machine_id((systemd, dbus)) == "0123456789abcdef0123456789abcdef"
    dbus.write_text("uninitialized\n")
    with pytest.raises(ConfigError, match="give --instance"):
        machine_id((systemd, dbus))


def test_agent_flag_follows_the_prometheus_major() -> None:
    assert agent_flag(2) == "--enable-feature=agent" and agent_flag(None) == "--enable-feature=agent"
    assert agent_flag(3) == "--agent"
    if shutil.which("prometheus"):
        major = prometheus_major("prometheus")
        assert major is not None and major >= 2
        unit = _edge("fleet", "agent", "--remote-write", "http://x/api/v1/write", "--unit",
                     "--prometheus", shutil.which("prometheus"))
        assert f" {agent_flag(major)} " in unit
    assert prometheus_major("/nonexistent/prometheus") is None


def test_agent_unit_orders_after_edge_socket_and_verifies(tmp_path: Path) -> None:
    unit = AgentSetup("http://x/api/v1/write", "dev1", binary="/bin/true").unit(2)
    lines = unit.splitlines()
    assert "After=network-online.target edge.socket" in lines and "Wants=network-online.target" in lines
    assert not any(k in unit for k in ("Requires=edge", "BindsTo=edge", "PartOf=edge"))  # reports while edge is down
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not found")
    path = tmp_path / "edge-prometheus-agent.service"
    path.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _answer(prom: Prometheus, expr: str) -> list | None:
    try:
        return prom.query(expr) or None
    except (urllib.error.URLError, OSError):  # 503 until its TSDB is open
        return None


def test_agent_scrapes_edge_and_remote_writes_to_a_receiver(tmp_path: Path, tiny_config: Path, service) -> None:
    need("prometheus")
    edge = service(tiny_config)
    receiver = Prometheus(tmp_path / "receiver", "global: {}\n", "--web.enable-remote-write-receiver")
    agent = None
    try:
        config = _edge("fleet", "agent", "--remote-write", f"http://127.0.0.1:{receiver.port}/api/v1/write",
                       "--instance", "dev1", "--target", f"127.0.0.1:{edge.address[1]}", "--interval", "1s")
        major = prometheus_major("prometheus")
        agent = Prometheus(tmp_path / "agent", config, agent_flag(major))
        build = until("edge_build_info at the receiver",
                      lambda: _answer(receiver, 'edge_build_info{job="edge",instance="dev1"}'), 90,
                      agent.proc, agent.log)
        from edge import __version__

        assert build[0]["metric"]["version"] == __version__
        ready = until("edge_ready at the receiver", lambda: _answer(receiver, 'edge_ready{instance="dev1"}'), 30)
        assert ready[0]["value"][1] == "1"
        # an agent answers no queries (it keeps only a WAL): what the receiver has came by remote write
        with pytest.raises(urllib.error.HTTPError):
            agent.query("edge_ready")
    finally:
        if agent is not None:
            agent.close()
        receiver.close()


# -- a device that serves TLS and keys its /metrics ------------------------------------------------
AGENT_KEY = "sk-agent-" + "5" * 32


def _tls_device(tmp_path: Path, tiny_gguf: Path, server: str = "") -> tuple[Path, Path]:
    """A config serving TLS with a certificate that names `edge-device.test` only (not 127.0.0.1,
    the address scraped) and API keys, the agent's among them: (the config, the certificate)."""
    from kit import write_config
    from kit.tls import self_signed

    cert, key = self_signed(tmp_path, dns=("edge-device.test",), ips=())
    keys = tmp_path / "api-keys"
    keys.write_text(f"sk-client-{'7' * 32}\n{AGENT_KEY}\n")
    keys.chmod(0o600)
    config = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"\n'
                          f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n{server}')
    return config, cert


def _credentials_as_systemd_makes_them(text: str, folder: Path, cert: Path, key_file: Path) -> str:
    """The agent's config with its credential folder at `folder`, holding the copies systemd's
    LoadCredential= makes at /run/credentials/edge-prometheus-agent.service."""
    from edge.fleet.agent import CREDENTIALS

    folder.mkdir()
    (folder / "edge-tls-ca").write_bytes(cert.read_bytes())
    (folder / "edge-api-key").write_bytes(key_file.read_bytes())
    return text.replace(CREDENTIALS, str(folder))


def test_a_tls_device_with_keyed_metrics_is_scraped_over_https_with_a_key(tmp_path: Path, tiny_gguf: Path) -> None:
    promtool = need("promtool")
    config, cert = _tls_device(tmp_path, tiny_gguf)
    args = ["fleet", "agent", "--remote-write", "https://fleet.example/api/v1/write", "--config", str(config),
            "--target", "127.0.0.1:8088"]
    text = _edge(*args)
    assert "    scheme: https\n" in text
    assert 'ca_file: "/run/credentials/edge-prometheus-agent.service/edge-tls-ca"' in text
    assert 'server_name: "edge-device.test"' in text  # 127.0.0.1 is not in the certificate: its name is
    assert 'type: Bearer\n      credentials_file: "/run/credentials/edge-prometheus-agent.service/edge-api-key"' in text
    (tmp_path / "agent.yml").write_text(text)
    check = [promtool, "check", "config", "--agent"]
    r = subprocess.run([*check, "--syntax-only", str(tmp_path / "agent.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    key_file = tmp_path / "agent.key"
    key_file.write_text(AGENT_KEY + "\n")
    (tmp_path / "full.yml").write_text(_credentials_as_systemd_makes_them(text, tmp_path / "creds", cert, key_file))
    r = subprocess.run([*check, str(tmp_path / "full.yml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr  # the files it names, checked too
    unit = _edge(*args, "--unit", "--key-file", str(key_file))
    assert f"LoadCredential=edge-tls-ca:{cert}\n" in unit and f"LoadCredential=edge-api-key:{key_file}\n" in unit
    assert "LoadCredential=edge-api-key:/etc/edge/prometheus-agent.key" in _edge(*args, "--unit")  # the default
    if shutil.which("systemd-analyze"):
        (tmp_path / "edge-prometheus-agent.service").write_text(unit.replace("/usr/bin/prometheus", "/bin/true"))
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edge-prometheus-agent.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    # metrics opened on purpose: no key sent; a plain device: plain HTTP
    (tmp_path / "open").mkdir()
    opened, _ = _tls_device(tmp_path / "open", tiny_gguf, 'metrics_auth = "open"')
    text = _edge("fleet", "agent", "--remote-write", "https://f/api/v1/write", "--config", str(opened))
    assert "scheme: https" in text and "credentials_file" not in text
    from kit import write_config

    plain = _edge("fleet", "agent", "--remote-write", "https://f/api/v1/write", "--config",
                  str(write_config(tmp_path / "plain.toml", tiny_gguf)))
    assert "scheme:" not in plain and "ca_file" not in plain and "credentials_file" not in plain


def test_the_agent_scrapes_a_tls_keyed_device_and_remote_writes(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """The printed config, with its credentials where systemd would put them, in the real agent:
    /metrics answers 401 without the key, and the receiver gets edge_ready by remote write."""
    need("prometheus")
    config, cert = _tls_device(tmp_path, tiny_gguf)
    edge = service(config)
    trusting = ssl.create_default_context(cafile=str(cert))
    trusting.check_hostname = False  # the certificate names edge-device.test, the test reaches 127.0.0.1
    with httpx.Client(verify=trusting, timeout=60) as client:
        assert client.get(f"https://127.0.0.1:{edge.address[1]}/metrics").status_code == 401  # keyed by default
    receiver = Prometheus(tmp_path / "receiver", "global: {}\n", "--web.enable-remote-write-receiver")
    agent = None
    try:
        text = _edge("fleet", "agent", "--remote-write", f"http://127.0.0.1:{receiver.port}/api/v1/write",
                     "--instance", "dev-tls", "--config", str(config), "--interval", "1s",
                     "--target", f"127.0.0.1:{edge.address[1]}")
        key_file = tmp_path / "agent.key"
        key_file.write_text(AGENT_KEY + "\n")
        agent = Prometheus(tmp_path / "agent", _credentials_as_systemd_makes_them(text, tmp_path / "creds", cert,
                                                                                   key_file),
                           agent_flag(prometheus_major("prometheus")))
        ready = until("edge_ready of the TLS device at the receiver",
                      lambda: _answer(receiver, 'edge_ready{instance="dev-tls"}'), 90, agent.proc, agent.log)
        assert ready[0]["value"][1] == "1"
    finally:
        if agent is not None:
            agent.close()
        receiver.close()
