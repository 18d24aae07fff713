"""`edge doctor`'s check of who may use the service, before a start: the addresses it will
listen on (the socket unit's ListenStream=, else the config's [server] table), the API keys
(the unit's `LoadCredential=edge-api-keys:`, else `api_key_file`) and TLS; what a start would
refuse with exit 78 (a non-loopback socket and no key, edge.serve.auth) is a fail here too,
and a port opened on purpose (`allow_unauthenticated = true`) a warning."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

from edge.errors import ConfigError
from edge.serve.auth import CREDENTIAL, exposure_problem, is_loopback, load_api_keys, parse_keys, read_private

if TYPE_CHECKING:
    from edge.config import Config
    from edge.serve.auth import ApiKeys

__all__ = ["access_checks", "listen_is_loopback", "served_access", "socket_listen"]

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]
NAME = "access"
FIX = ("put keys in /etc/edge/api-keys (root's, mode 0600) and uncomment the unit's "
       f"LoadCredential={CREDENTIAL}:/etc/edge/api-keys, or set [server] api_key_file; or set [server] "
       "allow_unauthenticated = true to serve it open on purpose (docs/security.md)")


def socket_listen(unit_dirs: list[Path]) -> list[str] | None:
    """The ListenStream= values of the installed edge.socket (the first unit dir with both units)."""
    for d in unit_dirs:
        if (d / "edge.socket").is_file() and (d / "edge.service").is_file():
            return re.findall(r"^ListenStream=\s*(\S+)", (d / "edge.socket").read_text(), re.M)
    return None


def listen_is_loopback(spec: str) -> bool:
    """Whether a ListenStream= value (or a host:port) is reachable from this machine only: a
    Unix socket, or a loopback address; a bare port listens on every interface."""
    if spec.startswith(("/", "@")):
        return True
    if spec.isdigit() or ":" not in spec:
        return False
    host = spec[1:spec.index("]")] if spec.startswith("[") else spec.rsplit(":", 1)[0]
    return is_loopback(host)


def _keys(cfg: Config, unit_text: str | None) -> tuple[ApiKeys | None, str, Check | None]:
    """The keys a start would read, where from, and a check if they cannot be read."""
    cred = re.search(rf"^LoadCredential={CREDENTIAL}:(\S+)", unit_text or "", re.M)
    where = f"the unit's credential {CREDENTIAL} ({cred.group(1)})" if cred else f"api_key_file ({cfg.server.api_key_file})"
    try:
        if cred:
            path = Path(cred.group(1))
            from edge.serve.auth import ApiKeys

            return ApiKeys(parse_keys(read_private(path, cfg.source, "server.api_key_file"), path, cfg.source),
                           str(path), metrics_keyed=cfg.server.metrics_auth == "key"), where, None
        return load_api_keys(cfg.server, cfg.source), where, None
    except ConfigError as exc:
        level = "warn" if "Permission denied" in str(exc) else "fail"
        return None, where, (NAME, level, f"API keys from {where}: {exc}" +
                             (" (run edge doctor as root to check them)" if level == "warn" else ""),
                             "" if level == "warn" else "fix the key file as the message says")


def _tls(cfg: Config, unit_text: str | None) -> list[Check]:
    """The certificate and key a start would load: the unit's credentials, else the config's."""
    from edge.serve.tls import CERT_CREDENTIAL, KEY_CREDENTIAL, tls_files

    creds = dict(re.findall(r"^LoadCredential=(edge-tls-\w+):(\S+)", unit_text or "", re.M))
    server = dataclasses.replace(cfg.server, tls_cert_file=creds.get(CERT_CREDENTIAL, cfg.server.tls_cert_file),
                                 tls_key_file=creds.get(KEY_CREDENTIAL, cfg.server.tls_key_file))
    try:
        found = tls_files(server, cfg.source)
    except ConfigError as exc:
        return [("tls", "fail", str(exc), "point tls_cert_file/tls_key_file at PEM files that match")]
    return [("tls", "ok", f"serves TLS with {found.cert}", "")] if found else []


def served_access(cfg: Config, unit_text: str | None) -> tuple[Path | None, bool]:
    """What a client of the device needs: the certificate it serves TLS with (the unit's
    credential's source, else tls_cert_file; None: plain HTTP), and whether /metrics needs a key
    (keys configured by the credential or api_key_file, and metrics_auth = "key")."""
    from edge.serve.auth import resolve
    from edge.serve.tls import CERT_CREDENTIAL

    cred = re.findall(rf"^LoadCredential={CERT_CREDENTIAL}:(\S+)", unit_text or "", re.M)
    s = cfg.server
    cert = Path(cred[-1]) if cred else resolve(s.tls_cert_file, cfg.source) if s.tls_cert_file else None
    keys = bool(re.search(rf"^LoadCredential={CREDENTIAL}:\S", unit_text or "", re.M) or s.api_key_file)
    return cert, keys and s.metrics_auth == "key"


def access_checks(cfg: Config, unit_dirs: list[Path], unit_text: str | None) -> list[Check]:
    listen = socket_listen(unit_dirs)
    s = cfg.server
    addresses = listen if listen is not None else [s.unix_socket or f"{s.host}:{s.port}"]
    wide = [a for a in addresses if not listen_is_loopback(a)]
    keys, where, unreadable = _keys(cfg, unit_text)
    out = [unreadable] if unreadable else []
    if keys is not None:
        out.append((NAME, "ok", f"every request but /healthz and /readyz{'' if keys.metrics_keyed else ' and /metrics'} "
                    f"needs one of the {len(keys.digests)} API keys from {where}", ""))
    if not wide:
        out.append((NAME, "ok", f"listens on {', '.join(addresses)}: this machine only", ""))
    elif keys is None and unreadable is None:
        problem = exposure_problem(", ".join(wide), None, s)
        if problem:
            out.append((NAME, "fail", f"a start would exit 78: {problem}", FIX))
        else:
            out.append((NAME, "warn", f"{', '.join(wide)} is open to anyone who can reach it, with no API key "
                        "(allow_unauthenticated = true)", FIX))
    return out + _tls(cfg, unit_text)
