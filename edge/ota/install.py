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
            back (to the factory state after a first install); V's marker says failed. Where
            that version is damaged beyond repair, the highest intact committed one instead.

recover: deletes staging dirs, temp links and files and every version dir without .complete;
in PENDING it rolls back (a version never committed was never confirmed healthy: not served
after a crash or reboot); in IDLE it makes the links agree, finishes an interrupted repair and,
at boot, checks the current version (edge.ota.repair). Then it prunes. Every path that makes a
version current again checks its files against its signed manifest first (edge.ota.recheck).
Every refusal comes before the first write, on a fresh device too. Every file-system call goes
through edge.ota.fsops.Fs (tests fail it with ENOSPC at each one; the kill matrix kills at each).
"""

from __future__ import annotations

import errno
import fcntl
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from edge.errors import EdgeError
from edge.ota import links
from edge.ota.activate import Activator, activation_report, run_activation
from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError, OtaBusy, OtaIOError, OtaStateError, RolledBackUnhealthy
from edge.ota.fsops import Fs, make_dirs
from edge.ota.policy import refuse
from edge.ota.rebuild import EMPTY, rebuild_state
from edge.ota.repair import RepairMixin
from edge.ota.retention import clean_garbage, prune
from edge.ota.statefile import StateFile, now, overwrite_marker, read_marker
from edge.ota.store import Store
from edge.ota.version import highest

__all__ = ["Ota", "LINKS"]

LINKS = links.LINKS
MAX_DIGESTS = 200  # versions whose content is remembered (same version, new content: refused)
MAX_REASON = 600  # characters of a history reason (the state file has a fixed size)
ActivatorLike = Union[Activator, Callable[[], "tuple[bool, str]"], None]


@dataclass
class Ota(RepairMixin):
    root: Path  # <state_dir>/ota
    keep: int = 3
    fs: Fs = field(default_factory=Fs)
    config: Path | None = None  # the device config: recorded as the factory state at the first install
    pubkey: Path | None = None  # checks an installed manifest's signature before a switch back to it
    _store: Store | None = field(default=None, init=False, repr=False)

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    @property
    def store(self) -> Store:
        """One per command: an object hashed once is not hashed again by the same command."""
        if self._store is None:
            self._store = Store(self.root, self.fs)
        return self._store

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
            st = rebuild_state(self.root, problem, self.pubkey)
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
            {"at": now(), "version": version, "event": event, **({"reason": reason} if reason else {})}]

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
        """The lock; a file-system error inside is one line naming the file and the state left."""
        try:
            make_dirs(self.versions)  # 0755: the service, another user, reads the versions
            with open(self.root / ".lock", "a") as lock:  # "a": an existing lock file is not truncated
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OtaBusy(f"another edge ota command is running on {self.root}: try again when it "
                                  "is done") from None
                yield
        except OSError as exc:
            raise self._stopped(exc) from None

    def _stopped(self, exc: OSError) -> EdgeError:
        where = f"{exc.filename}{f' -> {exc.filename2}' if exc.filename2 else ''}" if exc.filename else str(self.root)
        try:
            st = self.state()
            left = f"current {st['current']}, pending {(st['pending'] or {}).get('version')}"
        except (OSError, EdgeError):
            left = "unreadable"
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return (OtaStateError if full else OtaIOError)(
            f"{where}: {exc.strerror or exc}: the command stopped there, the OTA state is {left} "
            f"({'free space and ' if full else ''}run it again; `edge ota status` shows the state)")

    # -- staging -------------------------------------------------------------------------------
    def _stage(self, bundle: Bundle, st: dict[str, Any]) -> dict[str, Any]:
        """The version on disk: staged from the bundle, or (there already) checked and repaired."""
        if read_marker(self.versions / bundle.version):
            return {"staged": "already on disk (same content)", "checked": self._recheck(bundle.version, bundle)}
        from edge.ota.stage import stage

        return stage(self.versions, self.store, self.fs, bundle, st["highest"])

    def _recheck(self, version: str, bundle: Bundle | None = None) -> dict[str, Any]:
        from edge.ota.recheck import recheck

        return recheck(self.versions / version, self.store, self.fs, pubkey=self.pubkey,
                       bundle=bundle if bundle is not None and bundle.version == version else None)

    def _mark(self, st: dict[str, Any], version: str, state: str) -> None:
        overwrite_marker(self.fs, self.versions / version, version, state, st["highest"])

    # -- install / commit / rollback -----------------------------------------------------------
    def install(self, bundle: Bundle, activate: ActivatorLike, device: Any = None, *,
                allow_downgrade: bool = False, commit: bool = True) -> dict[str, Any]:
        """activate None: switch only (`edge ota commit` later). commit False: activate and
        health-check, but leave the version pending for `edge ota commit` (Mender's ArtifactCommit)."""
        from edge.ota.checks import check_bundle, check_device

        check_bundle(bundle)
        check_device(bundle, device)
        made = None if self.root.exists() else self.root  # a fresh device: the first folder made here
        while made is not None and not made.parent.exists():
            made = made.parent
        with self._locked():
            try:
                return self._install(bundle, activate, allow_downgrade, commit)
            except BaseException:
                if made is not None and not self.state()["history"]:
                    self.fs.rmtree(made)  # nothing got as far as PENDING: a refusal leaves nothing
                raise

    def _install(self, bundle: Bundle, activate: ActivatorLike, allow_downgrade: bool,
                 commit: bool) -> dict[str, Any]:
        st = self.state()
        refuse(self.versions, self.store, bundle, st, allow_downgrade)
        check = getattr(activate, "check", None)
        if check is not None and st["current"] != bundle.version:
            check()  # a reload activator finds the running service before anything is touched
        # a version still pending (never committed) goes first, and the answer says so
        earlier = self._recover(activate, f"still pending (never committed) when the install of "
                                          f"{bundle.version} began", bundle, current=False)
        before = {"rolled_back_first": {k: earlier[k] for k in ("failed", "reason")}} if earlier else {}
        try:
            return {**self._switch(bundle, activate, allow_downgrade, commit), **before}
        except EdgeError as exc:
            if earlier:
                exc.args = (f"{exc} (before that, the pending version {earlier['failed']} was rolled back: "
                            f"{earlier['reason']})",)
            raise

    def _switch(self, bundle: Bundle, activate: ActivatorLike, allow_downgrade: bool,
                commit: bool) -> dict[str, Any]:
        self.slots.ensure_slots()
        st = self.state()
        refuse(self.versions, self.store, bundle, st, allow_downgrade)  # again: a rollback may have pruned
        if st["current"] == bundle.version:
            return self._already_current(bundle, activate)
        self._first_install(st)
        staged = self._stage(bundle, st)
        st["pending"] = {"version": bundle.version, "previous": st["previous"]}
        st["digests"] = dict(list({**st["digests"], bundle.version: bundle.content_digest}.items())[-MAX_DIGESTS:])
        self._event(st, bundle.version, "staged")
        self._save(st)  # write #1: IDLE -> PENDING
        self._sync_links(st)
        if activate is None:
            return {"result": "switched", "version": bundle.version, **staged, "note": "not activated: run "
                    "`edge ota commit` once the service is healthy, or `edge ota rollback`"}
        ok, why = run_activation(activate)
        if not ok:
            return self._rollback(activate, f"health check failed: {why}")
        report = activation_report(activate)
        if not commit:
            return {"result": "healthy", "version": bundle.version, **staged, **report, "note":
                    "pending: `edge ota commit` makes it permanent; a reboot or `edge ota recover` rolls it back"}
        return {**self._commit(), **staged, **report}

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
        st.update(previous=st["current"], current=version, pending=None, highest=highest(st["highest"], version),
                  repair=None)  # a repair of the version before is moot: this one serves
        self._event(st, version, "committed")
        self._save(st)  # write #2: PENDING -> IDLE on the new version
        self._mark(st, version, "committed")  # with the floor: a rebuild finds it there
        self._sync_links(st)
        self._prune(st)
        return {"result": "committed", "version": version, "previous": st["previous"]}

    def _rollback(self, activate: ActivatorLike, reason: str, bundle: Bundle | None = None,
                  retire: bool = False) -> dict[str, Any]:
        """`retire`: the version rolled back is removed too, once the switch is written (a fall
        back from a version damaged beyond repair: edge.ota.repair)."""
        st = self.state()
        if st["pending"]:
            bad, target = st["pending"]["version"], st["current"]
        elif st["previous"]:
            bad, target = st["current"], st["previous"]
        else:
            raise BundleError(f"{reason}: nothing to roll back to (no install pending, no previous version)")
        gone = [bad] if retire else []  # removed with the switch (a kill before: the next recover does it)
        target, checked = self._checked_target(bad, target, bundle, f"{bad} cannot be rolled back ({reason})",
                                               bool(st["pending"] or retire), gone)
        if st["pending"] and target == st["current"]:
            st["pending"] = None  # current and previous are still what they were before the install
        else:
            st.update(pending=None, current=target, previous=None)
        st.update(repair=None, retire=gone or None)  # `target` was checked in full just now; this activates it
        self._event(st, bad, "rolled back", reason)
        self._save(st)  # write #2': back to IDLE on the version before
        self._mark(st, bad, "failed")
        if target:
            self._mark(st, target, "committed")  # the floor lives on in the current version's marker
        self._sync_links(st)
        self._prune(st)
        self._retire_owed()  # a version damaged beyond repair, once the switch is written
        result = {"result": "rolled back", "version": st["current"], "failed": bad, "reason": reason, **checked}
        if st["current"] is None:
            if not self._factory_ok(st):
                why = (st.get("factory") or {}).get("unavailable", "none was recorded")
                result["note"] = f"that was the first install: no version is installed now, and no factory config ({why})"
                return result
            result["factory"] = st["factory"]["config"]
            result["note"] = ("that was the first install: the service is back on its factory config "
                              f"({st['factory']['config']}, recorded at the first install)")
        if activate is not None:
            ok, why = run_activation(activate)
            if not ok:
                st = self.state()
                self._event(st, st["current"], "rollback unhealthy", why)
                self._save(st)
                went_to = st["current"] or "the factory config"
                raise RolledBackUnhealthy(f"{bad} rolled back ({reason}) to {went_to}, which is not healthy "
                                          f"either: {why}")
        return result

    def _recover(self, activate: ActivatorLike, why: str = "never committed: the install was killed, "
                 "the power was cut, or it was not confirmed before a reboot",
                 bundle: Bundle | None = None, boot: bool = False, current: bool = True,
                 pending: bool = True) -> dict[str, Any] | None:
        """`boot`: nothing to activate, the current version checked as a boot can afford;
        `current` False: no look at the current version (an install's); `pending` False: a pending
        install is left alone (a start's: its commit or rollback decides it)."""
        clean_garbage(self.root, self.fs)
        st = self.state()
        if st["pending"]:
            return self._rollback(activate, why, bundle) if pending else None
        if self._first_install(st) or "rebuilt" in st:
            self._save(st)
        for name in (st["current"], st["previous"]):  # a kill between write #2 and the marker
            if name and read_marker(self.versions / name) not in ("committed", None):
                self._mark(st, name, "committed")
        want = self.wanted_links(st)["current"]
        if want not in (None, links.FACTORY) and self.link_target("current") != want:
            self._recheck(want)  # recover's own choice (a rebuilt state, a rollback killed mid-switch)
        self._sync_links(st)
        self._retire_owed()  # a fall back killed before it removed the damaged version
        # an interrupted repair finished; at boot, a look at the current version (not in an install:
        # its own bundle repairs the current version, another version replaces it)
        done = self._check_current(self.state(), activate, boot) if current else None
        if done is None or done["result"] != "rolled back":  # a fall back pruned already
            self._prune(self.state())
        return done

    def _prune(self, st: dict[str, Any]) -> None:
        prune(self.root, self.store, self.fs, self.keep, {v for v in self.wanted_links(st).values() if v})

    # -- commands ------------------------------------------------------------------------------
    def recover(self, activate: ActivatorLike, boot: bool = False) -> dict[str, Any] | None:
        """`boot`: before the service starts (nothing to activate), the current version checked as
        a boot can afford (edge.ota.repair)."""
        with self._locked():
            return self._recover(activate, boot=boot)

    def commit(self) -> dict[str, Any]:
        with self._locked():
            return self._commit()

    def rollback(self, activate: ActivatorLike, reason: str = "requested by operator") -> dict[str, Any]:
        with self._locked():
            clean_garbage(self.root, self.fs)
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
        st["on_disk"] = sorted(d.name for d in self.versions.glob("*") if (d / ".complete").is_file())
        st["store"] = self.store.usage()
        return st
