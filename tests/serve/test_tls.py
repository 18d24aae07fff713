"""TLS (edge.serve.tls): uvicorn's own, on the socket systemd hands over. A self-signed
certificate for 127.0.0.1 made with `cryptography` (kit.tls); a socket-activated `edge serve` with
API keys; real TLS clients (httpx, the `openai` client) over 127.0.0.1 that trust only that
certificate. Then the config errors of a certificate and key that do not go together."""

from __future__ import annotations

import secrets
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge.config import ServerConfig
from edge.errors import ConfigError
from edge.serve.tls import tls_files
from kit import EDGE, PidOne, write_config
from kit.tls import self_signed

KEY = "sk-edge-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[tuple[PidOne, Path]]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(d)
    keys = d / "api-keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cfg = write_config(d / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"\ntls_cert_file = "{cert}"\n'
                                                          f'tls_key_file = "{key}"')
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        yield pid1, cert
        assert pid1.stop() == 0


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))  # this certificate only, hostname checked


def test_https_with_the_key_is_served_over_the_inherited_socket(tls_service: tuple[PidOne, Path]) -> None:
    pid1, cert = tls_service
    base = f"https://127.0.0.1:{pid1.address[1]}"
    with httpx.Client(verify=trusting(cert), timeout=60) as client:
        assert client.get(f"{base}/healthz").status_code == 200
        assert client.get(f"{base}/v1/models").status_code == 401
        r = client.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
        assert r.extensions["http_version"] == b"HTTP/1.1"


def test_the_openai_client_over_tls(tls_service: tuple[PidOne, Path]) -> None:
    openai = pytest.importorskip("openai")
    pid1, cert = tls_service
    with httpx.Client(verify=trusting(cert), timeout=60) as http:
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{pid1.address[1]}/v1", api_key=KEY,
                               max_retries=0, http_client=http)
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2)
        assert answer.choices[0].finish_reason in ("length", "stop")


def test_plain_http_and_an_untrusted_certificate_get_nothing(tls_service: tuple[PidOne, Path], tmp_path: Path) -> None:
    pid1, _ = tls_service
    with socket.create_connection(("127.0.0.1", pid1.address[1]), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
        assert not s.recv(4096).startswith(b"HTTP/1.1 200")  # a TLS alert or a close, never an answer
    other, _ = self_signed(tmp_path, "other")
    with httpx.Client(verify=trusting(other), timeout=30) as client, pytest.raises(httpx.ConnectError):
        client.get(f"https://127.0.0.1:{pid1.address[1]}/healthz")


def test_tls_config_errors_name_the_field(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    other_cert, _ = self_signed(tmp_path, "other")
    assert tls_files(ServerConfig(), "edge.toml") is None
    found = tls_files(ServerConfig(tls_cert_file=str(cert), tls_key_file=str(key)), "edge.toml")
    assert found is not None and found.cert == cert and found.key == key
    with pytest.raises(ConfigError, match="server.tls_key_file: tls_cert_file is set but tls_key_file is not"):
        tls_files(ServerConfig(tls_cert_file=str(cert)), "edge.toml")
    with pytest.raises(ConfigError, match="server.tls_cert_file: cannot serve TLS with the certificate"):
        tls_files(ServerConfig(tls_cert_file=str(other_cert), tls_key_file=str(key)), "edge.toml")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="server.tls_key_file: .* is readable by every user"):
        tls_files(ServerConfig(tls_cert_file=str(cert), tls_key_file=str(key)), "edge.toml")


# -- handshakes hold no slot -----------------------------------------------------------------------
SILENT = 20  # TCP connections that never send a ClientHello
HANDSHAKE_S = 3.0  # header_timeout_s: from the accept, the TLS handshake included


@pytest.fixture(scope="module")
def capped_tls(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[tuple[PidOne, Path]]:
    d = tmp_path_factory.mktemp("capped")
    cert, key = self_signed(d)
    keys = d / "api-keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cfg = write_config(d / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"\ntls_cert_file = "{cert}"\n'
                                                          f'tls_key_file = "{key}"\nmax_connections = 16\n'
                                                          f"header_timeout_s = {HANDSHAKE_S}")
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        yield pid1, cert
        assert pid1.stop() == 0


def _keyed_get(pid1: PidOne, cert: Path, path: str = "/v1/models") -> tuple[float, httpx.Response]:
    """A keyed HTTPS request on a new connection: (seconds to its answer, the answer)."""
    t0 = time.perf_counter()
    with httpx.Client(verify=trusting(cert), timeout=120) as client:
        r = client.get(f"https://127.0.0.1:{pid1.address[1]}{path}", headers={"Authorization": f"Bearer {KEY}"})
    return time.perf_counter() - t0, r


def test_silent_connections_do_not_delay_a_keyed_request_at_the_cap(capped_tls: tuple[PidOne, Path]) -> None:
    """At max_connections = 16, 20 connections that never start their TLS handshake are shed as
    fresh plain ones are (counted from their accept): a keyed HTTPS request is answered at
    once, not after asyncio's 60 s handshake timeout or even header_timeout_s."""
    pid1, cert = capped_tls
    baseline, r = _keyed_get(pid1, cert)
    assert r.status_code == 200
    before = _shed(pid1, cert)
    silent = [socket.create_connection(("127.0.0.1", pid1.address[1]), timeout=60) for _ in range(SILENT)]
    try:
        took, r = _keyed_get(pid1, cert)
    finally:
        for s in silent:
            s.close()
    print(f"\n{SILENT} silent TLS connections at max_connections 16: a keyed request answered in "
          f"{took:.3f} s (alone: {baseline:.3f} s)")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert took - baseline < 1.0 < HANDSHAKE_S  # shed, not freed by a timeout
    assert _shed(pid1, cert) - before >= SILENT - 16 + 1


def _shed(pid1: PidOne, cert: Path) -> float:
    _, r = _keyed_get(pid1, cert, "/metrics")
    return next(float(line.split()[-1]) for line in r.text.splitlines()
                if line.startswith("edge_connections_shed_total "))


def test_a_handshake_that_never_comes_is_ended_at_header_timeout_s(capped_tls: tuple[PidOne, Path]) -> None:
    pid1, _ = capped_tls
    with socket.create_connection(("127.0.0.1", pid1.address[1]), timeout=60) as s:
        t0 = time.perf_counter()
        try:
            end = s.recv(1)  # the end of stream, once the guard ended the handshake
        except ConnectionResetError:
            end = b""
        waited = time.perf_counter() - t0
    assert end == b"" and HANDSHAKE_S * 0.9 <= waited < HANDSHAKE_S + 5, waited  # swept at most a tick late


def _served_certificate(port: int) -> bytes:
    """The DER certificate the service presents (not verified: which one is the question)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, ctx.wrap_socket(raw) as tls:
        return tls.getpeercert(binary_form=True)


def test_new_tls_files_are_served_after_a_handover_not_after_a_reload(tmp_path: Path, tiny_gguf: Path,
                                                                       service) -> None:
    """docs/security.md, "Rotating keys and certificates": tls_cert_file/tls_key_file are read at a
    start; a reload in place keeps serving the old certificate, a handover's new process the new."""
    import subprocess

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    cert, key = self_signed(tmp_path)
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"')
    pid1 = service(cfg)
    der = lambda path: x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)  # noqa: E731
    old = der(cert)
    assert _served_certificate(pid1.address[1]) == old
    (tmp_path / "new").mkdir()
    new_cert, new_key = self_signed(tmp_path / "new")
    new_cert.replace(cert)  # the same paths, new contents
    new_key.replace(key)
    assert der(cert) != old

    def reload(*args: str) -> None:
        r = subprocess.run([*EDGE, "reload", "--config", str(cfg), *args], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr

    reload("--in-place")
    assert _served_certificate(pid1.address[1]) == old
    reload("--process")
    assert _served_certificate(pid1.address[1]) == der(cert)
    assert pid1.stop() == 0
