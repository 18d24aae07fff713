"""Install a bundle on the device: verify, stage, switch, activate, health-check; commit or roll back.

Layout under <state_dir>/ota: objects/sha256/<hex> (the content store, edge.ota.store),
versions/<V>/ (hard links into it, edge.toml, manifest.json, manifest.sig, .complete, .link),
factory/ (edge.ota.factory), the `current` and `previous` symlinks (edge.ota.links), and
state.json with its spare state.json.prev (edge.ota.statefile). state.json is the truth; the
links are derived from it and `recover` makes them agree. The state machine (one durable write
per transition, each an atomic exchange of the two state slots, none allocating):

  IDLE      pending = null; current -> state.current, previous -> state.previous.
  (staging) no durable change: versions/.staging-V-PID is garbage until renamed to versions/V
            with its .complete marker (staged); recover deletes it.
  PENDING   write #1 {pending: {version: V, previous: <state.previous>}}: current -> V,
            previous -> state.current. The new version may now run, but is not committed.
  commit    write #2 {current: V, previous: old current, pending: null, highest: max}: IDLE;
            V's marker says committed.
  rollback  write #2' {pending: null} (current/previous as before the install): IDLE, links
            back (to the factory state after a first install); V's marker says failed.

recover: deletes staging dirs, temp links and files and every version dir without .complete;
in PENDING it rolls back (a version that was not committed was never confirmed healthy, so it is
never served after a crash or reboot); in IDLE it only makes the links agree. Then it prunes.
Every file-system call goes through edge.ota.fsops.Fs (tests kill the process at each one).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from edge.ota import links
from edge.ota.activate import Activator
from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError, OtaBusy, PolicyError, RolledBackUnhealthy, VersionError
from edge.ota.fsops import Fs
from edge.ota.manifest import content_digest
from edge.ota.rebuild import EMPTY, rebuild_state
from edge.ota.statefile import LEGACY, StateFile, overwrite_marker, read_marker
from edge.ota.store import Store
from edge.ota.version import Version, parse_version

__all__ = ["Ota", "LINKS"]

LINKS = links.LINKS
MAX_DIGESTS = 200  # versions whose content is remembered (same version, new content: refused)
MAX_REASON = 600  # characters of a history reason (the state file has a fixed size)
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
    config: Path | None = None  # the device config: recorded as the factory state at the first install

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    @property
    def store(self) -> Store:
        return Store(self.root, self.fs)

    @property
    def slots(self) -> StateFile:
        return StateFile(self.root, self.fs)

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """state.json; rebuilt from the disk (with a `rebuilt` note) when it is damaged, or gone
        while versions are installed."""
        st, problem = StateFile.parse(self.root / "state.json")
        if problem is not None:
            st, problem = StateFile.parse(self.root / "state.json")  # once more: a write's exchange
        if problem is None and st is None and self.versions.is_dir() and any(self.versions.iterdir()):
            problem = "state.json is missing"
        if problem is not None:
            st = rebuild_state(self.root, problem)
        st = st or {}
        for k, v in EMPTY.items():
            st.setdefault(k, json.loads(json.dumps(v)))
        return st

    def _save(self, st: dict[str, Any]) -> None:
        note = st.pop("rebuilt", None)
        if note:
            self._event(st, st["current"], "state rebuilt", note)
        self.slots.write(st)

    @staticmethod
    def _event(st: dict[str, Any], version: str | None, event: str, reason: str = "") -> None:
        if len(reason) > MAX_REASON:
            reason = reason[:MAX_REASON - 1] + "…"
        st["history"] = st["history"][-49:] + [
            {"at": _now(), "version": version, "event": event, **({"reason": reason} if reason else {})}]

    def link_target(self, name: str) -> str | None:
        target = links.read(self.root / name)
        return None if target is None else Path(target).name

    def _factory_ok(self, st: dict[str, Any]) -> bool:
        return bool(st.get("factory") and "config" in st["factory"] and (self.root / links.FACTORY).is_dir())

    def wanted_links(self, st: dict[str, Any]) -> dict[str, str | None]:
        if st["pending"]:
            cur, prev = st["pending"]["version"], st["current"]
        else:
            cur, prev = st["current"], st["previous"]
        if cur is None and self._factory_ok(st):
            cur = links.FACTORY  # no version installed: the service runs its factory config
        return {"current": cur, "previous": prev}

    def _sync_links(self, st: dict[str, Any]) -> None:
        changed = [links.point(self.root, self.fs, name, links.target_of(v))
                   for name, v in self.wanted_links(st).items()]
        if any(changed):
            self.fs.fsync_dir(self.root)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.versions.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:  # "a": an existing lock file is not truncated
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OtaBusy(f"another edge ota command is running on {self.root}: try again when it "
                              "is done") from None
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

    def check_content(self, bundle: Bundle) -> None:
        """A thin bundle: every file it does not carry must be on this device, named if not."""
        missing = self.store.missing(bundle.files)
        if missing:
            base = bundle.base or {}
            raise BundleError(
                f"{bundle.path}: a thin bundle (base {base.get('bundle_version')}) whose content this "
                f"device does not have intact: {'; '.join(f'{f.path} (sha256 {f.sha256[:16]}…, {f.size} bytes)' for f in missing)}. "
                "Nothing was written: install the full bundle, or one built on a version this device has")

    def _stage(self, bundle: Bundle) -> dict[str, Any]:
        from edge.ota.stage import stage

        return stage(self.versions, self.store, self.fs, bundle)

    # -- install / commit / rollback -----------------------------------------------------------
    def install(self, bundle: Bundle, activate: ActivatorLike, device: Any = None, *,
                allow_downgrade: bool = False, commit: bool = True) -> dict[str, Any]:
        """activate None: switch only (`edge ota commit` later). commit False: activate and
        health-check, but leave the version pending for `edge ota commit` (Mender's ArtifactCommit)."""
        from edge.ota.checks import check_bundle, check_device

        check_bundle(bundle)
        check_device(bundle, device)
        with self._locked():
            # a version still pending (never committed) goes first, and the answer says so; the
            # state is rebuilt here too if it is damaged, before the slots are (re)made
            earlier = self._recover(activate, f"still pending (never committed) when the install of "
                                              f"{bundle.version} began")
            self.slots.ensure_slots()
            st = self.state()
            self.check_policy(bundle, st, allow_downgrade)
            if st["current"] == bundle.version:
                return self._already_current(bundle)
            self.check_content(bundle)
            check = getattr(activate, "check", None)
            if check is not None:
                check()  # a reload activator finds the running service before anything switches
            self._first_install(st)
            staged = self._stage(bundle)
            st["pending"] = {"version": bundle.version, "previous": st["previous"]}
            st["digests"] = dict(list({**st["digests"], bundle.version: bundle.content_digest}.items())[-MAX_DIGESTS:])
            self._event(st, bundle.version, "staged")
            self._save(st)  # write #1: IDLE -> PENDING
            self._sync_links(st)
            before = {"rolled_back_first": {k: earlier[k] for k in ("failed", "reason")}} if earlier else {}
            if activate is None:
                return {"result": "switched", "version": bundle.version, **staged, **before, "note": "not "
                        "activated: run `edge ota commit` once the service is healthy, or `edge ota rollback`"}
            ok, why = _activate(activate)
            if not ok:
                return {**self._rollback(activate, f"health check failed: {why}"), **before}
            report = _report(activate)
            if not commit:
                return {"result": "healthy", "version": bundle.version, **staged, **report, **before, "note":
                        "pending: `edge ota commit` makes it permanent; a reboot or `edge ota recover` rolls it back"}
            return {**self._commit(), **staged, **report, **before}

    def _already_current(self, bundle: Bundle) -> dict[str, Any]:
        """The same content is installed; the bundle's own bytes are still checked, so that a
        tampered copy is refused as it would be on any other device."""
        from edge.ota.extract import scan

        bad = [f"{f.path} ({problem})" for f, problem in scan(bundle) if problem]
        if bad:
            raise BundleError(f"{bundle.path}: {len(bad)} file(s) fail their check: {'; '.join(bad)} "
                              f"(version {bundle.version} is installed and stays)")
        return {"result": "already-current", "version": bundle.version, "verified": "the bundle's files "
                "match its signed manifest; `edge ota verify` checks the installed ones"}

    def _first_install(self, st: dict[str, Any]) -> bool:
        """Before OTA takes over: record the config the service runs as the factory state."""
        if st["current"] is None and st["pending"] is None and st.get("factory") is None and self.config:
            from edge.ota.factory import record_factory

            st["factory"] = record_factory(self.root, self.fs, self.config)
            return True
        return False

    def _commit(self) -> dict[str, Any]:
        st = self.state()
        if not st["pending"]:
            raise BundleError(f"nothing to commit: no install is pending (current is {st['current']})")
        version = st["pending"]["version"]
        highest = [p for p in (_parsed(st["highest"]), parse_version(version)) if p is not None]
        st.update(previous=st["current"], current=version, pending=None, highest=str(max(highest)))
        self._event(st, version, "committed")
        self._save(st)  # write #2: PENDING -> IDLE on the new version
        overwrite_marker(self.fs, self.versions / version, version, "committed")
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
        overwrite_marker(self.fs, self.versions / bad, bad, "failed")
        self._sync_links(st)
        self._prune(st)
        result = {"result": "rolled back", "version": st["current"], "failed": bad, "reason": reason}
        if st["current"] is None:
            if not self._factory_ok(st):
                why = (st.get("factory") or {}).get("unavailable", "none was recorded")
                result["note"] = f"that was the first install: no version is installed now, and no factory config ({why})"
                return result
            result["factory"] = st["factory"]["config"]
            result["note"] = ("that was the first install: the service is back on its factory config "
                              f"({st['factory']['config']}, recorded at the first install)")
        if activate is not None:
            ok, why = _activate(activate)
            if not ok:
                st = self.state()
                self._event(st, st["current"], "rollback unhealthy", why)
                self._save(st)
                went_to = st["current"] or "the factory config"
                raise RolledBackUnhealthy(f"{bad} rolled back ({reason}) to {went_to}, which is not healthy "
                                          f"either: {why}")
        return result

    def _recover(self, activate: ActivatorLike, why: str = "never committed: the install was killed, "
                 "the power was cut, or it was not confirmed before a reboot") -> dict[str, Any] | None:
        self._clean_garbage()
        st = self.state()
        if st["pending"]:
            return self._rollback(activate, why)
        if self._first_install(st) or "rebuilt" in st:
            self._save(st)
        for name in (st["current"], st["previous"]):  # a kill between write #2 and the marker
            if name:
                overwrite_marker(self.fs, self.versions / name, name, "committed")
        self._sync_links(st)
        self._prune(st)
        return None

    def _clean_garbage(self) -> None:
        for p in sorted(self.root.glob(".*.lnk")) + sorted(self.root.glob(".*.tmp")):
            self.fs.unlink(p)
        for d in sorted(self.root.glob(f".{links.FACTORY}-*")):
            self.fs.rmtree(d)
        for d in sorted(self.versions.iterdir()):
            if d.name.startswith(".staging-") or (d.is_dir() and not (d / ".complete").is_file()):
                self.fs.rmtree(d)  # staged by a killed install, or half-pruned: never linked

    def _prune(self, st: dict[str, Any]) -> None:
        """Keep `keep` versions: current, previous and pending always; then the highest by
        SemVer among those that were committed; never-committed (failed, rolled back) ones
        go first. Then the store drops every object no kept version references."""
        protect = {v for v in self.wanted_links(st).values() if v}
        complete = [d for d in self.versions.iterdir() if read_marker(d)]
        others = [d for d in complete if d.name not in protect]

        def worth(d: Path) -> tuple[bool, Version]:
            return read_marker(d) in ("committed", LEGACY), _parsed(d.name) or parse_version("0.0.0-0")

        for d in sorted(others, key=worth)[:max(0, len(complete) - self.keep)]:
            self.fs.unlink(d / ".complete")  # incomplete first: a kill below leaves garbage, not a version
            self.fs.fsync_dir(d)
            self.fs.rmtree(d)
        self.store.collect()
        links.converge(self.root, self.fs, [d for d in self.versions.iterdir() if read_marker(d)]
                       + ([self.root / links.FACTORY] if (self.root / links.FACTORY).is_dir() else []))

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

    def verify(self, pubkey: Path | None) -> dict[str, Any]:
        """Read only: with nothing installed (no versions/), nothing is made, not even the lock."""
        from edge.ota.verify import verify_installed

        if not self.versions.is_dir():
            return verify_installed(self.root, pubkey)
        with self._locked():
            return verify_installed(self.root, pubkey)

    def status(self) -> dict[str, Any]:
        st = self.state()
        st.pop("digests")
        st["links"] = {name: self.link_target(name) for name in LINKS}
        st["on_disk"] = sorted(d.name for d in self.versions.glob("*") if (d / ".complete").is_file()) \
            if self.versions.exists() else []
        st["store"] = self.store.usage()
        return st


def _report(activate: ActivatorLike) -> dict[str, Any]:
    """What a reload activation did (kept, loaded), for the install's answer."""
    report = getattr(activate, "report", None)
    return {"reload": {k: report.get(k) for k in ("kept", "loaded", "mode")}} if report else {}

