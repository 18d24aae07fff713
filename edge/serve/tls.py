"""TLS: uvicorn's own, on the very sockets edge serves (its own, or those systemd hands over),
so that socket activation, the connection cap, the drain and the handover stay what they are.

`[server] tls_cert_file` / `tls_key_file`, or the systemd credentials `edge-tls-cert` /
`edge-tls-key` (`LoadCredential=`: the private key stays root's). Both are checked in the
start's sockets phase by loading them into an SSL context, so a wrong path, a key that does
not match its certificate or a key every user may read is a config error (78) naming the
field, not a failure at the first connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge.config import ServerConfig
from edge.errors import ConfigError
from edge.serve.auth import credential_path, read_private, resolve

__all__ = ["CERT_CREDENTIAL", "KEY_CREDENTIAL", "TlsFiles", "tls_files"]

CERT_CREDENTIAL = "edge-tls-cert"
KEY_CREDENTIAL = "edge-tls-key"


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


def _pick(credential: str, configured: str | None, source: str) -> Path | None:
    return credential_path(credential) or (resolve(configured, source) if configured else None)


def tls_files(server: ServerConfig, source: str) -> TlsFiles | None:
    """The certificate chain and private key to serve TLS with, checked; None: plain HTTP."""
    cert = _pick(CERT_CREDENTIAL, server.tls_cert_file, source)
    key = _pick(KEY_CREDENTIAL, server.tls_key_file, source)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        missing, have = ("tls_cert_file", "tls_key_file") if cert is None else ("tls_key_file", "tls_cert_file")
        raise ConfigError(source, f"server.{missing}", f"{have} is set but {missing} is not: TLS needs both "
                          "(or the credentials edge-tls-cert and edge-tls-key)")
    read_private(key, source, "server.tls_key_file")  # mode and readability, before OpenSSL reads it
    import ssl  # here: a start without TLS does not import it before its load

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(source, "server.tls_cert_file", f"cannot serve TLS with the certificate {cert} and "
                          f"the key {key}: {getattr(exc, 'reason', None) or exc.strerror or exc} (expected "
                          "PEM files, the key matching the certificate)") from None
    return TlsFiles(cert, key)
