"""`edge doctor`'s check that the service's user can open every file the service will open, as
the installed unit runs it: the config, the models and their declared prefix files, the TLS
certificate and key, the API key file.

Read from the unit's own text, drop-ins included (edge.host.units.with_drop_ins), not assumed:
who the service runs as (`DynamicUser=`: a uid that owns nothing, in `SupplementaryGroups=`
only; `User=`; else root), and what its namespace hides (`ProtectHome=yes` and `tmpfs`:
/home, /root and /run/user; `InaccessiblePaths=`, `TemporaryFileSystem=`; `PrivateTmp=`: /tmp
and /var/tmp are its own; `BindPaths=`/`BindReadOnlyPaths=` show a path again under the tmpfs
kinds; `ProtectHome=read-only`, and `ReadOnlyPaths=`, hide nothing). A file passed as a systemd
credential (`LoadCredential=`) is read by systemd as root, not by the service: it is not
checked here. Permissions are read from mode bits, owner and group (POSIX ACLs are not read).
Each file that cannot be opened is a fail naming it, why, and the fix: a credential for a
secret, another directory or the unit's setting for the rest. doctor runs this before any start.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.config import Config

__all__ = ["Sandbox", "sandbox_checks"]

Check = tuple[str, str, str, str]  # (name, level, message, fix): edge.host.doctor makes its Check of each
NAME = "unit files"
_HOMES = ("/home", "/root", "/run/user")
_TRUE = frozenset({"yes", "true", "on", "1"})
# a file of the config's [server] table -> the credential that passes it instead
_CREDENTIALS = {"server.tls_cert_file": "edge-tls-cert", "server.tls_key_file": "edge-tls-key",
                "server.api_key_file": "edge-api-keys"}


def _settings(unit_text: str) -> dict[str, list[str]]:
    """Each key's values in order, as systemd reads them (an empty assignment resets a list)."""
    out: dict[str, list[str]] = {}
    for key, value in re.findall(r"^\s*([A-Za-z]+)=(.*)$", unit_text, re.M):
        out[key] = [] if not value.strip() else [*out.get(key, []), value.strip()]
    return out


def _last(settings: dict[str, list[str]], key: str, default: str = "") -> str:
    return (settings.get(key) or [default])[-1]


def _on(settings: dict[str, list[str]], key: str) -> bool:
    return _last(settings, key).lower() in _TRUE


def _paths(settings: dict[str, list[str]], key: str) -> list[str]:
    """The paths of a list setting (`-` and `+` prefixes off; for bind and tmpfs settings, the
    path inside the namespace)."""
    out = []
    for value in settings.get(key, []):
        for item in value.split():
            parts = item.lstrip("-+").split(":")
            out.append(parts[1] if key.startswith("Bind") and len(parts) > 1 and parts[1] else parts[0])
    return out


@dataclass(frozen=True)
class Sandbox:
    """Who the service runs as and what its namespace hides, from the unit's settings."""

    who: str  # in words, for the messages
    uid: int | None  # None: a dynamic user (owns nothing)
    gids: frozenset[int]
    hidden: tuple[tuple[str, str, bool], ...]  # (path, the setting that hides it, a tmpfs: binds show through)
    shown: tuple[str, ...]  # BindPaths=/BindReadOnlyPaths=: visible again under a tmpfs
    credentials: frozenset[str]  # LoadCredential= ids

    @classmethod
    def of(cls, unit_text: str) -> Sandbox:
        s = _settings(unit_text)
        groups = [g for v in s.get("SupplementaryGroups", []) for g in v.split()]
        gids = {gr.gr_gid for gr in map(_group, groups) if gr is not None}
        home = _last(s, "ProtectHome", "read-only" if _on(s, "DynamicUser") else "no").lower()  # implied by it
        hidden = [(h, f"ProtectHome={home}", home == "tmpfs") for h in _HOMES if home in _TRUE | {"tmpfs"}]
        hidden += [(p, "InaccessiblePaths=", False) for p in _paths(s, "InaccessiblePaths")]
        hidden += [(p, "TemporaryFileSystem=", True) for p in _paths(s, "TemporaryFileSystem")]
        hidden += [(p, "PrivateTmp=yes", True) for p in ("/tmp", "/var/tmp") if _on(s, "PrivateTmp")]
        shown = tuple(_paths(s, "BindPaths") + _paths(s, "BindReadOnlyPaths"))
        creds = frozenset(v.split(":", 1)[0] for v in s.get("LoadCredential", []))
        in_groups = f", in {' '.join(groups)}" if groups else ""
        if _on(s, "DynamicUser"):
            return cls(f"its DynamicUser (a uid of its own{in_groups})", None, frozenset(gids), tuple(hidden), shown, creds)
        user = _last(s, "User")
        pw = _user(user) if user else _user(str(os.geteuid()))  # no User=: as doctor runs (root, for a system unit)
        if pw is None:
            return cls(f"User={user} (no such user here)", -1, frozenset(), tuple(hidden), shown, creds)
        gids |= {pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem)}
        return cls(f"User={user}" if user else f"{pw.pw_name} (no User=)", pw.pw_uid, frozenset(gids),
                   tuple(hidden), shown, creds)

    def hides(self, path: Path) -> str | None:
        """The setting that hides `path` from the service, if one does."""
        for root, setting, tmpfs in self.hidden:
            if _under(path, root) and not (tmpfs and any(_under(path, s) for s in self.shown)):
                return f"{setting} hides {root}"
        return None

    def denied(self, path: Path) -> str | None:
        """Why the service's user cannot open `path` by its mode bits (a folder on its way it may not
        enter, or the file it may not read); None when it can, or the file is missing."""
        if self.uid == 0 or not path.exists():
            return None
        real = path.resolve()
        for d in [*reversed(real.parents)]:
            if not self._allows(d.stat(), stat.S_IXUSR):
                return f"its folder {d} ({_mode(d)}) is closed to {self.who}"
        if not self._allows(real.stat(), stat.S_IRUSR):
            return f"{self.who} may not read it ({_mode(real)})"
        return None

    def _allows(self, st: os.stat_result, owner_bit: int) -> bool:
        shift = 0 if st.st_uid == self.uid else 3 if st.st_gid in self.gids else 6
        return bool(st.st_mode & (owner_bit >> shift))


def _group(name: str) -> grp.struct_group | None:
    try:
        return grp.getgrnam(name)
    except KeyError:
        return None


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
    except KeyError:
        return None


def _under(path: Path, root: str) -> bool:
    return path == Path(root) or Path(root) in path.parents


def _mode(path: Path) -> str:
    st = path.stat()
    owner = _name(pwd.getpwuid, st.st_uid)
    group = _name(grp.getgrgid, st.st_gid)
    return f"mode {stat.S_IMODE(st.st_mode):04o}, {owner}:{group}"


def _name(lookup: object, ident: int) -> str:
    try:
        return str(lookup(ident)[0])  # type: ignore[operator]
    except KeyError:
        return str(ident)


def service_files(cfg: Config) -> list[tuple[str, str, Path]]:
    """(what it is, the config's field, path) of each file the service opens itself."""
    from edge.config import BUILTIN_PREFIX
    from edge.serve.auth import resolve

    base = Path(cfg.source).parent if Path(cfg.source).is_file() else Path.cwd()
    out = [("the config", "--config", Path(cfg.source))] if Path(cfg.source).is_file() else []
    for i, m in enumerate(cfg.models):
        if not m.path.startswith(BUILTIN_PREFIX):
            out.append((f"model {m.name}", f"models[{i}].path", Path(m.path)))
        out += [(f"prefix {p.name} of {m.name}", f"models[{i}].prefixes[{j}].file", base / p.file)
                for j, p in enumerate(m.prefixes) if p.file]
    s = cfg.server
    for field, label in (("tls_cert_file", "TLS certificate"), ("tls_key_file", "TLS key"),
                         ("api_key_file", "API keys")):
        value = getattr(s, field)
        if value:
            out.append((label, f"server.{field}", resolve(value, cfg.source)))
    return out


def sandbox_checks(cfg: Config, unit_text: str | None) -> list[Check]:
    """One fail per file the installed unit's service could not open; one ok when it can open all."""
    if unit_text is None:
        return []
    box = Sandbox.of(unit_text)
    out = []
    files = [(what, field, path) for what, field, path in service_files(cfg)
             if _CREDENTIALS.get(field) not in box.credentials]  # a credential: systemd reads it, as root
    for what, field, path in files:
        hidden = box.hides(path) or box.hides(path.resolve())
        why = f"the unit's {hidden}" if hidden else box.denied(path)
        if why:
            out.append((NAME, "fail", f"{what} {path} ({field}): the service cannot open it under edge.service: "
                        f"{why}", _fix(field, path, hidden)))
    if not out and files:
        out.append((NAME, "ok", f"{box.who} can open {', '.join(str(p) for _, _, p in files)} under edge.service", ""))
    return out


def _fix(field: str, path: Path, hidden: str | None) -> str:
    cred = _CREDENTIALS.get(field)
    if cred:
        return (f"pass it as a credential: `systemctl edit edge.service`, add LoadCredential={cred}:{path} under "
                "[Service], then `systemctl restart edge.service` (systemd reads it as root and hands the service "
                "its own copy; docs/security.md)")
    if hidden:
        return (f"move it out of {hidden.rsplit(' ', 1)[-1]} (e.g. to /var/lib/edge-models or /opt/edge) and point "
                f"{field} there, or add ProtectHome=tmpfs and BindReadOnlyPaths={path.parent} to the unit in a drop-in")
    return (f"let the service read it: chmod o+r {path} and o+x on its folders, or give it to a group the unit's "
            "SupplementaryGroups= names (chgrp, then chmod g+r)")
