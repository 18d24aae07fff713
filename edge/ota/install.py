"""Install a bundle on the device: verify, stage, switch, activate, health-check; commit or roll back.

Layout under <state_dir>/ota: versions/<V>/ (files, edge.toml, manifest.json, .complete),
`current` and `previous` symlinks, state.json. state.json is the truth; the links are derived
from it and `recover` makes them agree. The state machine (one durable write per transition,
each an atomic rename of state.json):

  IDLE      pending = null; current -> state.current, previous -> state.previous.
  (staging) no durable change: versions/.staging-V-PID is garbage until renamed to versions/V
            with its .complete marker; recover deletes it.
  PENDING   write #1 {pending: {version: V, previous: <state.previous>}}: current -> V,
            previous -> state.current. The new version may now run, but is not committed.
  commit    write #2 {current: V, previous: old current, pending: null, highest: max}: IDLE.
  rollback  write #2' {pending: null} (current/previous as before the install): IDLE, links back.

recover: deletes staging dirs, temp links and files and every version dir without .complete;
in PENDING it rolls back (a version that was not committed was never confirmed healthy, so it is
never served after a crash or reboot); in IDLE it only makes the links agree. Then it prunes.
Every file-system call goes through edge.ota.fsops.Fs (tests kill the process at each one).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from edge.ota.activate import Activator
from edge.ota.bundle import Bundle, content_digest
from edge.ota.errors import BundleError, PolicyError, VersionError
from edge.ota.fsops import Fs
from edge.ota.version import Version, parse_version

__all__ = ["Ota", "LINKS"]

LINKS = ("current", "previous")
MAX_DIGESTS = 200  # versions whose content is remembered (same version, new content: refused)
ActivatorLike = Union[Activator, Callable[[], "tuple[bool, str]"], None]


def _activate(act: ActivatorLike) -> tuple[bool, str]:
    return act.activate() if hasattr(act, "activate") else act()  # type: ignore[union-attr, misc]


def _parsed(text: str | None) -> Version | None:
    """A version recorded by an edge before the grammar existed does not order: it is skipped."""
    try:
        return parse_version(text)
    except VersionError:
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Ota:
    root: Path  # <state_dir>/ota
    keep: int = 3
    fs: Fs = field(default_factory=Fs)

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            st = json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            st = {}
        for k, v in (("current", None), ("previous", None), ("pending", None), ("highest", None),
                     ("digests", {}), ("history", [])):
            st.setdefault(k, v)
        return st

    def _save(self, st: dict[str, Any]) -> None:
        self.fs.atomic_write(self.root / "state.json", (json.dumps(st, indent=2) + "\n").encode())

    @staticmethod
    def _event(st: dict[str, Any], version: str | None, event: str, reason: str = "") -> None:
        st["history"] = st["history"][-49:] + [
            {"at": _now(), "version": version, "event": event, **({"reason": reason} if reason else {})}]

    def link_target(self, name: str) -> str | None:
        try:
            return Path(os.readlink(self.root / name)).name
        except OSError:
            return None

    @staticmethod
    def wanted_links(st: dict[str, Any]) -> dict[str, str | None]:
        if st["pending"]:
            return {"current": st["pending"]["version"], "previous": st["current"]}
        return {"current": st["current"], "previous": st["previous"]}

    def _sync_links(self, st: dict[str, Any]) -> None:
        changed = False
        for name, version in self.wanted_links(st).items():
            if self.link_target(name) == version and (version or not os.path.lexists(self.root / name)):
                continue
            if version is None:
                self.fs.unlink(self.root / name)
            else:
                tmp = self.root / f".{name}.{os.getpid()}.lnk"
                if os.path.lexists(tmp):
                    self.fs.unlink(tmp)
                self.fs.symlink(f"versions/{version}", tmp)
                self.fs.replace(tmp, self.root / name)  # rename over the old link: atomic switch
            changed = True
        if changed:
            self.fs.fsync_dir(self.root)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.versions.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BundleError(f"another edge ota command is running on {self.root}") from None
            yield

    # -- policy and staging --------------------------------------------------------------------
    def _installed_digest(self, version: str, st: dict[str, Any]) -> str | None:
        try:
            return content_digest(json.loads((self.versions / version / "manifest.json").read_text()))
        except (OSError, ValueError):
            return st["digests"].get(version)

    def check_policy(self, bundle: Bundle, st: dict[str, Any], allow_downgrade: bool) -> None:
        v = bundle.parsed_version
        known = self._installed_digest(bundle.version, st)
        if known is not None and known != bundle.content_digest:
            raise PolicyError(f"{bundle.path}: version {v} was installed on this device before with "
                              "other content: a new content needs a new version")
        floor = [_parsed(x) for x in (st["highest"], st["current"]) if x]
        floor = [f for f in floor if f is not None]
        if floor and v < max(floor) and not allow_downgrade:
            raise PolicyError(f"{bundle.path}: version {v} is older than {max(floor)}, the highest "
                              "version this device has committed (a downgrade, or the replay of an "
                              "old bundle): pass --allow-downgrade to install it on purpose")

    def _stage(self, bundle: Bundle) -> None:
        from edge.ota.extract import check_free_space, extract_files

        final = self.versions / bundle.version  # validated: no path characters, not empty
        if (final / ".complete").is_file():
            return  # staged before, same content (check_policy compared it)
        check_free_space(bundle, self.versions)
        if os.path.lexists(final):
            self.fs.rmtree(final)  # incomplete, never linked
        staging = self.versions / f".staging-{bundle.version}-{os.getpid()}"
        self.fs.mkdir(staging)
        try:
            extract_files(bundle, staging, self.fs)
            for name, data in (("edge.toml", bundle.manifest["config"].encode()),
                               ("manifest.json", bundle.raw_manifest),
                               (".complete", bundle.version.encode() + b"\n")):
                self.fs.write_file(staging / name, data)
            for d in sorted((p for p in staging.rglob("*") if p.is_dir()), reverse=True):
                self.fs.fsync_dir(d)
            self.fs.fsync_dir(staging)
            self.fs.replace(staging, final)
            self.fs.fsync_dir(self.versions)
        except BaseException:
            self.fs.rmtree(staging)
            raise

    # -- install / commit / rollback -----------------------------------------------------------
    def install(self, bundle: Bundle, activate: ActivatorLike, device: Any = None, *,
                allow_downgrade: bool = False, commit: bool = True) -> dict[str, Any]:
        """activate None: switch only (`edge ota commit` later). commit False: activate and
        health-check, but leave the version pending for `edge ota commit` (Mender's ArtifactCommit)."""
        from edge.ota.checks import check_edge_version, check_references

        check_edge_version(bundle)
        check_references(bundle, device)
        with self._locked():
            self._recover(activate)
            st = self.state()
            self.check_policy(bundle, st, allow_downgrade)
            if st["current"] == bundle.version:
                return {"result": "already-current", "version": bundle.version}
            self._stage(bundle)
            st["pending"] = {"version": bundle.version, "previous": st["previous"]}
            st["digests"] = dict(list({**st["digests"], bundle.version: bundle.content_digest}.items())[-MAX_DIGESTS:])
            self._event(st, bundle.version, "staged")
            self._save(st)  # write #1: IDLE -> PENDING
            self._sync_links(st)
            if activate is None:
                return {"result": "switched", "version": bundle.version, "note": "not activated: run "
                        "`edge ota commit` once the service is healthy, or `edge ota rollback`"}
            ok, why = _activate(activate)
            if not ok:
                return self._rollback(activate, f"health check failed: {why}")
            if not commit:
                return {"result": "healthy", "version": bundle.version, "note": "pending: `edge ota "
                        "commit` makes it permanent; a reboot or `edge ota recover` rolls it back"}
            return self._commit()

    def _commit(self) -> dict[str, Any]:
        st = self.state()
        if not st["pending"]:
            raise BundleError(f"nothing to commit: no install is pending (current is {st['current']})")
        version = st["pending"]["version"]
        highest = [p for p in (_parsed(st["highest"]), parse_version(version)) if p is not None]
        st.update(previous=st["current"], current=version, pending=None, highest=str(max(highest)))
        self._event(st, version, "committed")
        self._save(st)  # write #2: PENDING -> IDLE on the new version
        self._sync_links(st)
        self._prune(st)
        return {"result": "committed", "version": version, "previous": st["previous"]}

    def _rollback(self, activate: ActivatorLike, reason: str) -> dict[str, Any]:
        st = self.state()
        if st["pending"]:
            bad = st["pending"]["version"]
            st["pending"] = None  # current and previous are still what they were before the install
        elif st["previous"]:
            bad = st["current"]
            st.update(current=st["previous"], previous=None)
        else:
            raise BundleError(f"{reason}: nothing to roll back to (no install pending, no previous version)")
        self._event(st, bad, "rolled back", reason)
        self._save(st)  # write #2': back to IDLE on the version before
        self._sync_links(st)
        self._prune(st)
        result = {"result": "rolled back", "version": st["current"], "failed": bad, "reason": reason}
        if st["current"] is None:
            result["note"] = "that was the first install: no version is installed now"
        elif activate is not None:
            ok, why = _activate(activate)
            if not ok:
                st = self.state()
                self._event(st, st["current"], "rollback unhealthy", why)
                self._save(st)
                raise BundleError(f"{reason}; rolled back to {st['current']}, which is not healthy either: {why}")
        return result

    def _recover(self, activate: ActivatorLike) -> dict[str, Any] | None:
        self._clean_garbage()
        st = self.state()
        if st["pending"]:
            return self._rollback(activate, "never committed: the install was killed, the power was "
                                  "cut, or it was not confirmed before a reboot")
        self._sync_links(st)
        self._prune(st)
        return None

    def _clean_garbage(self) -> None:
        for p in sorted(self.root.glob(".*.lnk")) + sorted(self.root.glob(".*.tmp")):
            self.fs.unlink(p)
        for d in sorted(self.versions.iterdir()):
            if d.name.startswith(".staging-") or (d.is_dir() and not (d / ".complete").is_file()):
                self.fs.rmtree(d)  # staged by a killed install, or half-pruned: never linked

    def _prune(self, st: dict[str, Any]) -> None:
        """Keep `keep` complete versions (current, previous and pending always among them)."""
        protect = {v for v in self.wanted_links(st).values() if v}
        others = sorted((d for d in self.versions.iterdir() if (d / ".complete").is_file()
                         and d.name not in protect), key=lambda d: d.stat().st_mtime, reverse=True)
        for d in others[max(0, self.keep - len(protect)):]:
            self.fs.unlink(d / ".complete")  # incomplete first: a kill below leaves garbage, not a version
            self.fs.fsync_dir(d)
            self.fs.rmtree(d)

    # -- commands ------------------------------------------------------------------------------
    def recover(self, activate: ActivatorLike) -> dict[str, Any] | None:
        with self._locked():
            return self._recover(activate)

    def commit(self) -> dict[str, Any]:
        with self._locked():
            return self._commit()

    def rollback(self, activate: ActivatorLike, reason: str = "requested by operator") -> dict[str, Any]:
        with self._locked():
            self._clean_garbage()
            return self._rollback(activate, reason)

    def status(self) -> dict[str, Any]:
        st = self.state()
        st.pop("digests")
        st["links"] = {name: self.link_target(name) for name in LINKS}
        st["on_disk"] = sorted(d.name for d in self.versions.glob("*") if (d / ".complete").is_file()) \
            if self.versions.exists() else []
        return st
