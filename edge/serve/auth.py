"""Who may ask: API keys, read from a file or a systemd credential, checked before any work.

Keys come from `$CREDENTIALS_DIRECTORY/edge-api-keys` when the unit passes that credential
(`LoadCredential=edge-api-keys:/etc/edge/api-keys`: the file stays root's, the DynamicUser
never sees it), else from `[server] api_key_file`; one key per line, `#` comments and blank
lines ignored. They are read at every start and every reload (a reload's new set carries the
keys read with its config). A secret file (the keys, the TLS key: `read_private`) must be one
only its owner (and a group, for reading) can use: readable by every user, writable by its group
or every user, in a directory its group or every user may write (a sticky one such as /tmp
too: anyone may create a file there under the name you will use next), or below a directory
every user may write that is not sticky (anyone could rename the folders on its path) is a
config error (exit 78) naming it; so is a file that holds no key, or a key shorter than
`MIN_KEY_CHARS`, naming the line and never the key. `edge doctor` reads them with the same
functions.

`AuthMiddleware` (in front of the server's request limits, edge.lifecycle.serving) answers a
request without a valid key (`Authorization: Bearer <key>` or `x-api-key: <key>`) with OpenAI's
401 (`invalid_api_key`, `WWW-Authenticate: Bearer`) from its head alone, before the body is
read and before any handler runs: a flood of bad keys costs one SHA-256 and a comparison per
key each, and never reaches a model's queue. Only `/healthz`, `/readyz` and KServe's
`/v2/health/ready` are always open (systemd, load balancers); `/metrics` is keyed like the rest
unless `metrics_auth = "open"` opens it on purpose. Warm-up's own requests (marked by their private transport, never by anything a client sends)
pass. No key ever appears in a log line, a metric label or an error message.

`check_exposure` refuses to serve a non-loopback socket without keys (`no open port by accident`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.config import ServerConfig
from edge.errors import ConfigError

__all__ = ["ApiKeys", "AuthMiddleware", "CREDENTIAL", "MIN_KEY_CHARS", "OPEN_PATHS", "check_exposure", "credential_path",
           "exposure_problem", "is_loopback", "key_file", "load_api_keys", "parse_keys", "read_private", "resolve",
           "secret_problem", "served_open", "socket_address"]

log = logging.getLogger("edge")

CREDENTIAL = "edge-api-keys"
MIN_KEY_CHARS = 16  # 64 bits of hex at the least: `openssl rand -hex 32` makes 64 characters
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/ready"})  # probes: no work, no data
_FIELD = "server.api_key_file"
_CHALLENGE = {"missing": b'Bearer realm="edge"', "invalid": b'Bearer realm="edge", error="invalid_token"'}
_MESSAGE = {"missing": "no API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            "invalid": "the API key sent is not one this service accepts"}


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """The SHA-256 digests of the accepted keys (the keys themselves are not kept), where they
    were read from, and whether /metrics needs one."""

    digests: tuple[bytes, ...]
    origin: str
    metrics_keyed: bool = True

    def __repr__(self) -> str:  # never the keys, whatever prints this
        return f"ApiKeys({len(self.digests)} keys from {self.origin})"

    def accepts(self, given: bytes) -> bool:
        """Whether `given` is one of the keys, in time that depends on neither the keys nor how
        much of one matched: digests of equal length, every one compared (no early exit)."""
        digest = hashlib.sha256(given).digest()
        found = False
        for d in self.digests:
            found |= hmac.compare_digest(d, digest)
        return found

    def keyed(self, path: str) -> bool:
        return path not in OPEN_PATHS and (self.metrics_keyed or path != "/metrics")

    def refusal(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """None when a header carries an accepted key; else "missing" or "invalid"."""
        sent = []
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    sent.append(token.strip())
            elif name == b"x-api-key" and value.strip():
                sent.append(value.strip())
        if not sent:
            return "missing"
        return None if any(self.accepts(k) for k in sent[:2]) else "invalid"


def credential_path(name: str) -> Path | None:
    """`$CREDENTIALS_DIRECTORY/<name>` when systemd passed that credential, else None."""
    folder = os.environ.get("CREDENTIALS_DIRECTORY")
    path = Path(folder) / name if folder else None
    return path if path is not None and path.is_file() else None


def resolve(path: str, source: str) -> Path:
    """A [server] file path; a relative one is relative to the config file, as models' are."""
    p = Path(path)
    return p if p.is_absolute() or not Path(source).is_file() else Path(source).parent / p


def key_file(server: ServerConfig, source: str) -> Path | None:
    """Where the keys are read from: the credential, else api_key_file, else None (no keys)."""
    cred = credential_path(CREDENTIAL)
    if cred is not None:
        return cred
    return resolve(server.api_key_file, source) if server.api_key_file else None


def load_api_keys(server: ServerConfig, source: str) -> ApiKeys | None:
    """The keys this config (and the unit's credential) gives; None when none is configured."""
    path = key_file(server, source)
    if path is None:
        return None
    return ApiKeys(parse_keys(read_private(path, source, _FIELD), path, source), str(path),
                   metrics_keyed=server.metrics_auth == "key")


def read_private(path: Path, source: str, field: str) -> str:
    """A secret file's text; one that others may read or write (`secret_problem`), or that
    cannot be read, is a ConfigError naming it (its content is never quoted)."""
    try:
        problem = secret_problem(path)
        if problem:
            raise ConfigError(source, field, problem)
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(source, field, f"cannot read {path}: {why}") from None


def secret_problem(path: Path) -> str | None:
    """Why other users could read or replace the secret at `path` (None: they cannot): the file
    readable by every user, or writable by its group or every user; its directory writable by
    its group or every user (sticky or not); a directory above it every user may write and
    not sticky. OSError when it cannot be looked at."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & stat.S_IROTH:
        return (f"{path} is readable by every user (mode {mode:04o}): a secret must not be; chmod 600 {path} "
                "(or 640 for a group)")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "every user" if mode & stat.S_IWOTH else "its group"
        return (f"{path} is writable by {who} (mode {mode:04o}): they could put a key of their own in it; "
                f"chmod 600 {path} (or 640 for a group that reads it)")
    folder = path.absolute().parent
    for d in [folder, *folder.parents]:
        dmode = d.stat().st_mode
        open_to = stat.S_IWOTH | (stat.S_IWGRP if d == folder else 0)
        if dmode & open_to and (d == folder or not dmode & stat.S_ISVTX):
            who = "every user" if dmode & stat.S_IWOTH else "its group"
            return (f"{path} is in {d}, which {who} may write (mode {stat.S_IMODE(dmode):04o}): they could put "
                    "a file of their own in its place; keep secrets in a directory only root (or the service's "
                    "user) can write, e.g. /etc/edge (mode 0755, root's)")
    return None


def parse_keys(text: str, path: Path, source: str) -> tuple[bytes, ...]:
    """One key per line; `#` starts a comment line; blank lines are ignored. A key is printable
    ASCII without spaces (what a header carries); the error names the line, never the key."""
    digests = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
            raise ConfigError(source, _FIELD, f"{path} line {n}: expected one key per line, printable ASCII "
                              "without spaces (a comment line starts with #)")
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(source, _FIELD, f"{path} line {n}: the key is shorter than {MIN_KEY_CHARS} "
                              "characters: too easy to guess; make one with `openssl rand -hex 32`")
        digests.append(hashlib.sha256(key.encode("ascii")).digest())
    if not digests:
        raise ConfigError(source, _FIELD, f"{path} holds no key: expected one key per line "
                          "(e.g. from `openssl rand -hex 32`)")
    return tuple(digests)


class AuthMiddleware:
    """ASGI, in front of the request limits (so no body is read for a refused request): a
    request to a keyed path without an accepted key gets the 401 at once; the rest pass to
    `app`. The keys are those of the set serving when the request arrives (`current()`, whose
    `auth` a reload replaces); each refusal is counted in its metrics and passed to `observe`
    (route, status and duration, as the limits' own answers are)."""

    def __init__(self, app: Any, current: Callable[[], Any], observe: Callable[[dict[str, Any], int, float], None]) -> None:
        from edge.serve.warmscope import WARMUP_SCOPE_KEY  # here: the start's sockets phase imports this module

        self.app, self.current, self.observe = app, current, observe
        self.warmup_key = WARMUP_SCOPE_KEY

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state = self.current()
        keys: ApiKeys | None = state.auth
        if (keys is None or scope["type"] != "http" or scope.get(self.warmup_key) is True
                or not keys.keyed(scope["path"])):
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        reason = keys.refusal(scope["headers"])
        if reason is None:
            return await self.app(scope, receive, send)
        state.metrics.unauthorized(reason)
        body = json.dumps({"error": {"message": _MESSAGE[reason], "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", _CHALLENGE[reason])]})
        await send({"type": "http.response.body", "body": body})
        self.observe(scope, 401, time.perf_counter() - t0)


def is_loopback(host: str) -> bool:
    """Whether an address (an IP, `[v6]`, `localhost`) reaches this machine only."""
    host = host.strip("[]").split("%")[0]
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name that may resolve anywhere
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


def socket_address(sock: socket.socket) -> tuple[str, bool]:
    """(how the socket is named, whether only this machine can reach it), from getsockname()."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name!r}" if isinstance(name, bytes) else f"unix:{name}", True
    shown = f"[{name[0]}]:{name[1]}" if sock.family == socket.AF_INET6 else f"{name[0]}:{name[1]}"
    return shown, sock.family in (socket.AF_INET, socket.AF_INET6) and is_loopback(name[0])


def exposure_problem(address: str, keys: ApiKeys | None, server: ServerConfig) -> str | None:
    """Why serving `address` (not loopback) as configured would be an open port by accident."""
    if keys is not None or server.allow_unauthenticated:
        return None
    return (f"{address} is not a loopback address and no API key is configured: anyone who can reach it "
            f"could use every model. Either set [server] api_key_file (or pass the systemd credential "
            f"{CREDENTIAL}; docs/security.md), or set [server] "
            "allow_unauthenticated = true to serve it open on purpose")


def check_exposure(sockets: Iterable[socket.socket], keys: ApiKeys | None, server: ServerConfig,
                   source: str) -> list[str]:
    """ConfigError (78) for the first non-loopback socket that `keys` leave open; else the
    non-loopback addresses served (open on purpose, when allow_unauthenticated)."""
    exposed = []
    for sock in sockets:
        address, local = socket_address(sock)
        if local:
            continue
        problem = exposure_problem(f"the listening socket {address}", keys, server)
        if problem:
            raise ConfigError(source, _FIELD, problem)
        exposed.append(address)
    return exposed


def served_open(exposed: list[str], keys: ApiKeys | None) -> list[str]:
    """The sockets of `exposed` (others can reach them) that a set with `keys` serves with no
    key: all of them when it has none (allow_unauthenticated, which check_exposure let pass),
    else none. A start, and each reload whose new set serves them so, says it in one WARNING."""
    if keys is not None or not exposed:
        return []
    log.warning("serving %s with no API key (server.allow_unauthenticated = true): anyone who "
                "can reach it may use every model", ", ".join(exposed))
    return list(exposed)
