"""A repair of the current version is one transaction: whatever kills it, the next `edge ota
install`, `recover` or start finishes it, and the service ends up serving the repaired bytes (or,
where this device has no intact copy, the version before it).

    write R1   state.repair = {version, activate, since, what}: recorded before the first file
               changes; `activate` says a file the service reads (a model, edge.toml) will change,
               so the running service (which maps the damaged inode) must take the new one
    repair     each file by one atomic step (edge.ota.recheck)
    activate   the install's activation (restart or reload); at boot or at a start none is
               needed: the service about to start maps the repaired files
    write R2   state.repair = null, a `repaired` event in the history

A command that finds state.repair checks the version in full (a previous run was interrupted),
finishes the repair and carries out the activation even when every file is intact by then. A
boot (`recover --boot`) or a start checks the current version as a boot can afford (sizes and
sampled hashes: edge.ota.audit) when nothing was interrupted, repairs from what the device has,
and falls back to the version before it (a rollback, checked in full, the damaged version then
removed: its bundle installs it again) where the current version cannot be repaired or its
manifest does not verify; where the version a rollback goes back to is damaged beyond repair
too, to the highest committed version that is intact. RepairMixin is edge.ota.install.Ota's; it
uses the Ota's state writes.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from edge.ota.activate import activation_report, run_activation
from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError, RepairedUnhealthy
from edge.ota.fsops import Fs
from edge.ota.recheck import Inspection, inspect, remember_sampled, repair, summary
from edge.ota.statefile import LEGACY, now, read_marker
from edge.ota.store import Store

__all__ = ["RepairMixin"]

MAX_WHAT = 20  # files named in the record (the state file has a fixed size)


class RepairMixin:
    """The repair transaction, on edge.ota.install.Ota's state (the methods below it defines)."""

    root: Path
    pubkey: Path | None
    fs: Fs
    versions: Path
    store: Store

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _save(self, st: dict[str, Any]) -> None:
        raise NotImplementedError

    @staticmethod
    def _event(st: dict[str, Any], version: str | None, event: str, reason: str = "") -> None:
        raise NotImplementedError

    def _rollback(self, activate: Any, reason: str, bundle: Bundle | None = None,
                  retire: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def _recover(self, activate: Any, why: str = "", bundle: Bundle | None = None, boot: bool = False,
                 current: bool = True, pending: bool = True) -> dict[str, Any] | None:
        raise NotImplementedError

    def _recheck(self, version: str, bundle: Bundle | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def _already_current(self, bundle: Bundle, activate: Any) -> dict[str, Any]:
        """The current version's own bundle pushed again: the bundle's bytes checked, then the
        installed version against it (in full), repaired in one transaction (the module's
        docstring); an interrupted repair before it is finished the same way."""
        from edge.ota.recheck import refuse_tampered

        refuse_tampered(bundle)
        st = self.state()
        insp = inspect(self.versions / bundle.version, self.store, bundle=bundle,
                       device_key=self.pubkey)
        if not insp.damaged and not st.get("repair"):
            return {"result": "already-current", "version": bundle.version, "checked": summary(insp, []),
                    "verified": "the bundle's files match its signed manifest, and so do the installed ones"}
        return self._repair_current(st, insp, activate, bundle)

    def _repair_current(self, st: dict[str, Any], insp: Inspection, activate: Any, bundle: Bundle | None = None,
                        boot: bool = False) -> dict[str, Any]:
        version = st["current"]
        owed = st.get("repair") or {}
        record = {"version": version, "activate": bool(owed.get("activate")) or insp.served_changed,
                  "since": owed.get("since") or now(), "what": (owed.get("what") or insp.said())[:MAX_WHAT]}
        if record != owed:
            st["repair"] = record
            self._save(st)  # R1: before the first file changes
        repaired = repair(insp, self.store, self.fs, bundle, self.pubkey)
        result: dict[str, Any] = {"result": "repaired", "version": version, "checked": summary(insp, repaired)}
        if owed and not insp.damaged:
            result["note"] = f"finished the repair begun at {owed.get('since')}, which was interrupted"
        ok, why = True, ""
        if record["activate"] and not boot:
            if activate is None:
                result["note"] = ("not activated (--no-activate): restart or reload the service to serve the "
                                  "repaired files; the next install, recover or start does it")
                return self._repair_done(version, repaired, result, owed=True)
            ok, why = run_activation(activate)
            result.update(activation_report(activate))
        self._repair_done(version, repaired, result)
        if not ok:
            raise RepairedUnhealthy(f"{version} was repaired in place ({'; '.join(record['what'])}), but the "
                                    f"service is not healthy on it: {why}")
        return result

    def _repair_done(self, version: str, repaired: list[str], result: dict[str, Any],
                     owed: bool = False) -> dict[str, Any]:
        """R2: the record cleared (kept while an activation is owed), the history says so."""
        st = self.state()
        if not owed:
            st["repair"] = None
        if repaired:
            self._event(st, version, "repaired", "; ".join(repaired))
        self._save(st)
        return result

    def _check_current(self, st: dict[str, Any], activate: Any, boot: bool) -> dict[str, Any] | None:
        """recover's (and a start's) look at the current version: in full after an interrupted
        repair, else at boot sampled; repaired, or the version before it where it cannot be."""
        version, owed = st["current"], st.get("repair")
        if version is None or not (owed or boot):
            return None
        vdir = self.versions / version
        try:
            insp = inspect(vdir, self.store, pubkey=self.pubkey, sampled=not owed)
            if not insp.damaged and not owed:
                if not (vdir / ".sampled").exists():
                    remember_sampled(self.fs, vdir, insp.files)  # hashed in full just now
                return None
            return self._repair_current(st, insp, activate, boot=boot)
        except BundleError as exc:
            return self._fall_back(version, activate, str(exc))

    def _fall_back(self, version: str, activate: Any, why: str) -> dict[str, Any]:
        """The current version cannot be repaired on this device: the version before it (checked in
        full first), and the damaged one removed (its bundle installs it again: its content digest
        stays recorded). Where there is none, the refusal stands (exit 65, naming the file)."""
        st = self.state()
        if not st["previous"]:
            raise BundleError(f"{why}; and there is no version before {version} to fall back to")
        result = self._rollback(activate, f"damaged beyond repair on this device: {why}", retire=True)
        return {**result, "removed": version}

    def _retire_owed(self) -> None:
        """The version a fall back switched away from, removed (its .complete first), its objects
        collected; the state says so once done (a kill before: the next recover does it)."""
        st = self.state()
        owed = st.get("retire")
        if not owed:
            return
        kept = (st["current"], st["previous"], (st["pending"] or {}).get("version"))
        from edge.ota.retention import retire

        for version in [owed] if isinstance(owed, str) else owed:
            if isinstance(version, str) and version not in kept and "/" not in version and (self.versions / version).is_dir():
                retire(self.versions / version, self.fs)
        self.store.collect()  # also after a kill between the removal and here
        st["retire"] = None
        self._save(st)

    def _checked_target(self, bad: str, target: str | None, bundle: Bundle | None, why: str, instead: bool,
                        gone: list[str | None]) -> tuple[str | None, dict[str, Any]]:
        """The version a rollback goes to, checked (and repaired) in full; where it is damaged beyond
        repair and `instead` (not an operator's rollback, which goes where it was asked or nowhere),
        an intact committed version instead, the damaged one added to `gone`."""
        try:
            return target, {"checked": self._recheck(target, bundle)} if target else {}
        except BundleError as exc:
            if not instead:
                raise BundleError(f"{why}: {exc}") from None
            gone.append(target)
            return self._intact_instead({bad, target}, f"{why}: {exc}")

    def _intact_instead(self, damaged: set[str | None], why: str) -> tuple[str, dict[str, Any]]:
        """The highest committed version on this device (not `damaged`) whose files check (and
        repair) in full: where the version a rollback would go back to is damaged beyond repair."""
        from edge.ota.version import parsed

        on_disk = [d.name for d in self.versions.iterdir() if read_marker(d) in ("committed", LEGACY)]
        for v in sorted((v for v in on_disk if v not in damaged and parsed(v)), key=parsed, reverse=True):
            try:
                return v, {"checked": self._recheck(v), "instead": f"{v}: {why}"}
            except BundleError:
                continue
        raise BundleError(f"{why}; no other version on this device is intact")

    def at_start(self) -> dict[str, Any] | None:
        """The service's own start (edge.cli.launch, before its config is read): an interrupted
        repair finished, the current version checked as a boot checks it. Never waits: an OTA
        command holding the lock is activating the service itself. Never touches a pending
        install (its commit or rollback decides it)."""
        try:
            with open(self.root / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self._recover(None, boot=True, pending=False)
        except BlockingIOError:
            return None
