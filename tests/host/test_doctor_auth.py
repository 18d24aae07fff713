"""`edge doctor`'s access check (edge.host.doctor_auth): the addresses from the installed socket
unit (else the config), the keys from the unit's credential (else api_key_file), and what a start
would refuse, before any start."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import parse_config
from edge.host.doctor_auth import access_checks, listen_is_loopback

MODEL = '[[models]]\nname = "m"\npath = "m.gguf"\n'


@pytest.mark.parametrize("spec, local", [
    ("127.0.0.1:8088", True), ("[::1]:8088", True), ("localhost:8088", True), ("/run/edge/edge.sock", True),
    ("@edge", True), ("127.1.2.3:80", True), ("[::ffff:127.0.0.1]:80", True),
    ("0.0.0.0:8088", False), ("8088", False), ("[::]:8088", False), ("192.168.1.20:8088", False),
    ("edge.local:8088", False),
])
def test_listen_is_loopback(spec: str, local: bool) -> None:
    assert listen_is_loopback(spec) is local


def units(tmp_path: Path, listen: str, service: str = "") -> list[Path]:
    d = tmp_path / "units"
    d.mkdir()
    (d / "edge.socket").write_text(f"[Socket]\nListenStream={listen}\n")
    (d / "edge.service").write_text(f"[Service]\nExecStart=/x/edge serve\n{service}")
    return [d]


def test_a_wide_socket_without_keys_fails_as_the_start_would(tmp_path: Path) -> None:
    cfg = parse_config(MODEL)
    (check,) = access_checks(cfg, units(tmp_path, "0.0.0.0:8088"), None)
    assert check[:2] == ("access", "fail") and "a start would exit 78" in check[2] and "0.0.0.0:8088" in check[2]
    assert "LoadCredential=edge-api-keys" in check[3] and "allow_unauthenticated = true" in check[3]


def test_allow_unauthenticated_warns(tmp_path: Path) -> None:
    cfg = parse_config("[server]\nallow_unauthenticated = true\n" + MODEL)
    (check,) = access_checks(cfg, units(tmp_path, "8088"), None)
    assert check[1] == "warn" and "open to anyone" in check[2]


K1, K2 = "sk-doctor-" + "1" * 24, "sk-doctor-" + "2" * 24


def test_the_units_credential_is_read_and_checked(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"# keys\n{K1}\n{K2}\n")
    keys.chmod(0o600)
    line = f"LoadCredential=edge-api-keys:{keys}\n"
    checks = access_checks(parse_config(MODEL), units(tmp_path, "0.0.0.0:8088", line), line)
    assert [c[1] for c in checks] == ["ok"] and "2 API keys" in checks[0][2] and K1 not in checks[0][2]
    keys.chmod(0o644)
    checks = access_checks(parse_config(MODEL), [tmp_path / "units"], line)
    assert checks[0][1] == "fail" and "readable by every user" in checks[0][2]


@pytest.mark.parametrize("case, words", [
    ("mode 0602", "writable by every user (mode 0602)"), ("mode 0660", "writable by its group (mode 0660)"),
    ("folder 0777", "which every user may write (mode 0777)"), ("a 1-character key", "line 2: the key is shorter than 16"),
])
def test_doctor_applies_the_starts_key_file_rules(tmp_path: Path, case: str, words: str) -> None:
    """The same functions a start reads the keys with (edge.serve.auth): what a start refuses
    (exit 78), doctor fails, naming the file and the line, never the key."""
    folder = tmp_path / "keys"
    folder.mkdir()
    keys = folder / "api-keys"
    keys.write_text(f"{K1}\n" + ("Z\n" if case == "a 1-character key" else ""))
    keys.chmod(int(case.split()[1], 8) if case.startswith("mode") else 0o600)
    if case.startswith("folder"):
        folder.chmod(0o777)
    cfg = parse_config(f'[server]\napi_key_file = "{keys}"\n' + MODEL)
    (check,) = [c for c in access_checks(cfg, [tmp_path / "none"], None) if c[1] != "ok"]
    assert check[:2] == ("access", "fail") and words in check[2] and str(keys) in check[2], check
    assert K1 not in check[2] and "Z\n" not in check[2]


def test_loopback_only_from_the_config_when_no_unit_is_installed(tmp_path: Path) -> None:
    checks = access_checks(parse_config(MODEL), [tmp_path / "none"], None)
    assert checks == [("access", "ok", "listens on 127.0.0.1:8088: this machine only", "")]
    wide = parse_config('[server]\nhost = "0.0.0.0"\n' + MODEL)
    assert access_checks(wide, [tmp_path / "none"], None)[0][1] == "fail"


def test_tls_files_from_the_units_credentials_are_checked(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    key.chmod(0o600)
    line = f"LoadCredential=edge-tls-cert:{cert}\nLoadCredential=edge-tls-key:{key}\n"
    tls = [c for c in access_checks(parse_config(MODEL), [tmp_path / "none"], line) if c[0] == "tls"]
    assert len(tls) == 1 and tls[0][1] == "fail" and str(cert) in tls[0][2] and "tls_cert_file" in tls[0][2]
    assert not [c for c in access_checks(parse_config(MODEL), [tmp_path / "none"], None) if c[0] == "tls"]
