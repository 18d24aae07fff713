"""Install a bundle on the device: verify, stage, switch atomically, health-check, commit or roll back.

Layout under <state_dir>/ota: versions/<V>/ (files/, edge.toml, .complete), current and previous
(symlinks, switched by rename), state.json (current, previous, pending, history; atomic writes).
The `current` symlink is the truth of what runs. Every step can be killed (kill -9) and a rerun of
install, or `edge ota recover`, converges: on the old version, or on the new one fully installed.
EDGE_OTA_CRASH_AT=<step> kills the process at that step (fault-injection tests use it).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from edge.fsutil import atomic_write, fsync_dir
from edge.ota.bundle import Bundle, BundleError, FileEntry

__all__ = ["Ota", "Activator", "systemd_activator", "command_activator", "CRASH_STEPS"]

CRASH_STEPS = ("extract", "staged", "state-pending", "switched", "activated", "rollback")
Activator = Callable[[], tuple[bool, str]]  # restart the service; (healthy?, why not)


def _crash_point(step: str) -> None:
    if os.environ.get("EDGE_OTA_CRASH_AT") == step:
        os._exit(137)  # what kill -9 leaves behind, at exactly this step


def _wait_ready(url: str, timeout: float) -> tuple[bool, str]:
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback health URL from config
                if r.status == 200:
                    return True, ""
                last = f"HTTP {r.status}"
        except OSError as exc:
            last = str(getattr(exc, "reason", exc))
        time.sleep(0.2)
    return False, f"{url} not ready within {timeout:.0f} s ({last})"


def command_activator(cmd: str, health_url: str, timeout: float) -> Activator:
    def activate() -> tuple[bool, str]:
        try:
            r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)  # noqa: S602
        except subprocess.TimeoutExpired:
            return False, f"`{cmd}` did not finish within {timeout:.0f} s"
        if r.returncode != 0:
            return False, f"`{cmd}` exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
        return _wait_ready(health_url, timeout)
    return activate


def systemd_activator(unit: str, health_url: str, timeout: float) -> Activator:
    # For a Type=notify unit, `systemctl restart` returns only once READY=1 came, or the start failed.
    return command_activator(f"systemctl restart {unit}", health_url, timeout)


@dataclass
class Ota:
    root: Path  # <state_dir>/ota
    keep: int = 3

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            return {"current": None, "previous": None, "pending": None, "history": []}

    def _save(self, st: dict[str, Any]) -> None:
        atomic_write(self.root / "state.json", json.dumps(st, indent=2) + "\n")

    def _event(self, st: dict[str, Any], version: str | None, event: str, reason: str = "") -> None:
        st["history"] = (st.get("history") or [])[-49:] + [
            {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": version,
             "event": event, **({"reason": reason} if reason else {})}]

    def link_target(self, name: str) -> str | None:
        try:
            return Path(os.readlink(self.root / name)).name
        except OSError:
            return None

    def _link(self, name: str, version: str) -> None:
        tmp = self.root / f".{name}.{os.getpid()}.lnk"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("versions") / version, tmp)
        os.replace(tmp, self.root / name)  # rename over the old link: atomic switch
        fsync_dir(self.root)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.versions.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BundleError(f"another edge ota command is running on {self.root}") from None
            yield

    # -- staging -------------------------------------------------------------------------------
    def _stage(self, bundle: Bundle) -> Path:
        final = self.versions / bundle.version
        if (final / ".complete").is_file():
            return final  # a rerun: already staged in full
        for old in self.versions.glob(".staging-*"):
            shutil.rmtree(old, ignore_errors=True)  # leftovers of a killed install
        if final.exists():
            shutil.rmtree(final)  # incomplete: never visible through `current`
        staging = self.versions / f".staging-{bundle.version}-{os.getpid()}"
        staging.mkdir()
        try:
            self._extract(bundle, staging)
            (staging / "edge.toml").write_text(bundle.manifest["config"])
            (staging / "manifest.json").write_bytes(bundle.raw_manifest)
            (staging / ".complete").write_text(bundle.version + "\n")
            for p in staging.rglob("*"):
                if p.is_file():
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
            _crash_point("staged")
            os.replace(staging, final)
            fsync_dir(self.versions)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def _extract(self, bundle: Bundle, dest: Path) -> None:
        wanted = {f.path: f for f in bundle.files}
        seen: set[str] = set()
        with tarfile.open(bundle.path, "r:") as tar:
            for i, member in enumerate(tar):
                if i < 2:
                    continue  # manifest.json, manifest.sig: already verified
                self._extract_member(tar, member, wanted, dest)
                seen.add(member.name[len("files/"):])
                if i == 2:
                    _crash_point("extract")
        missing = sorted(set(wanted) - seen)
        if missing:
            raise BundleError(f"{bundle.path}: truncated bundle: missing {missing[:3]}")

    def _extract_member(self, tar: tarfile.TarFile, m: tarfile.TarInfo, wanted: dict[str, FileEntry],
                        dest: Path) -> None:
        if not m.isfile():
            kind = "symlink" if m.issym() else "hard link" if m.islnk() else "device or special file"
            raise BundleError(f"{tar.name}: refusing {kind} entry {m.name!r}")
        rel = m.name[len("files/"):] if m.name.startswith("files/") else None
        if rel is None or rel.startswith("/") or ".." in Path(rel).parts or rel not in wanted:
            raise BundleError(f"{tar.name}: refusing entry {m.name!r}: not a file the signed "
                              "manifest lists (path traversal or injected file)")
        entry = wanted[rel]
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(m)
        h, size = hashlib.sha256(), 0
        try:
            with src, open(target, "wb") as out:  # type: ignore[union-attr]
                while chunk := src.read(1 << 20):  # type: ignore[union-attr]
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                free = shutil.disk_usage(dest).free
                raise BundleError(f"disk full while extracting {rel} ({entry.size} bytes, {free} free "
                                  f"on {dest.parent}); the installed version is untouched") from None
            if isinstance(exc, (tarfile.TarError, EOFError)) or "unexpected end" in str(exc):
                raise BundleError(f"{tar.name}: truncated bundle at {rel}") from None
            raise
        except (tarfile.TarError, EOFError):
            raise BundleError(f"{tar.name}: truncated bundle at {rel}") from None
        if size != entry.size or h.hexdigest() != entry.sha256:
            raise BundleError(f"{tar.name}: {rel} fails its check: manifest says {entry.size} bytes, "
                              f"sha256 {entry.sha256[:16]}…; bundle has {size} bytes, "
                              f"sha256 {h.hexdigest()[:16]}…")

    # -- the device's key ----------------------------------------------------------------------
    def check_engines(self, bundle: Bundle, device: Any) -> None:
        """A bundle whose config serves engines must carry one for this device's key."""
        from edge.config import parse_config
        from edge.engines.key import EngineKey, key_for

        cfg = parse_config(bundle.manifest["config"], source=f"{bundle.path}: config")
        held = [EngineKey.from_dict(f.key) for f in bundle.files if f.kind == "engine" and f.key]
        for e in cfg.engines:
            if e.onnx_sha256 is None:
                raise BundleError(f"{bundle.path}: engine {e.name!r} must name onnx_sha256 and "
                                  "precision in a bundle config (devices hold no recipes)")
            wanted = key_for(e, device)
            if not any(k.model_sha256 == wanted.model_sha256 and not k.differences(wanted) for k in held):
                have = ", ".join(k.filename() for k in held if k.model == e.name) or "none"
                raise BundleError(f"{bundle.path}: no engine for this device's key: {e.name} needs "
                                  f"{wanted.filename()} (backend {wanted.backend}, target "
                                  f"{wanted.target}); the bundle has {have}")

    # -- install / commit / rollback -----------------------------------------------------------
    def install(self, bundle: Bundle, activate: Activator | None, device: Any = None) -> dict[str, Any]:
        from edge import __version__

        if _version_tuple(str(bundle.manifest.get("min_edge_version", "0"))) > _version_tuple(__version__):
            raise BundleError(f"{bundle.path}: needs edge >= {bundle.manifest['min_edge_version']}, "
                              f"this is {__version__}")
        if device is not None:
            self.check_engines(bundle, device)
        with self._locked():
            self._recover(activate)
            st = self.state()
            if self.link_target("current") == bundle.version and not st.get("pending"):
                return {"result": "already-current", "version": bundle.version}
            self._stage(bundle)
            old = self.link_target("current")
            st.update(pending=bundle.version, previous=old)
            self._event(st, bundle.version, "staged")
            self._save(st)
            _crash_point("state-pending")
            self._switch(bundle.version, old)
            _crash_point("switched")
            return self._health(activate)

    def _switch(self, new: str, old: str | None) -> None:
        if old and old != new:
            self._link("previous", old)
        self._link("current", new)
        st = self.state()
        st["current"] = new
        self._save(st)

    def _health(self, activate: Activator | None) -> dict[str, Any]:
        st = self.state()
        version = st["pending"]
        if activate is None:
            return {"result": "switched", "version": version, "note": "not activated: run "
                    "`edge ota commit` once the service is healthy, or `edge ota rollback`"}
        ok, why = activate()
        _crash_point("activated")
        if ok:
            return self._commit()
        return self._rollback(activate, f"health check failed: {why}")

    def _commit(self) -> dict[str, Any]:
        st = self.state()
        version = st.get("pending") or st.get("current")
        st["pending"] = None
        self._event(st, version, "committed")
        self._save(st)
        self._prune()
        return {"result": "committed", "version": version, "previous": st.get("previous")}

    def _rollback(self, activate: Activator | None, reason: str) -> dict[str, Any]:
        st = self.state()
        bad, good = self.link_target("current"), self.link_target("previous")
        if not good:
            st["pending"] = None
            self._event(st, bad, "failed", reason + "; no previous version to roll back to")
            self._save(st)
            raise BundleError(f"{reason}; no previous version to roll back to")
        self._link("current", good)
        _crash_point("rollback")
        st.update(current=good, pending=None)
        self._event(st, bad, "rolled back", reason)
        self._save(st)
        if activate is not None:
            ok, why = activate()
            if not ok:
                self._event(st, good, "rollback unhealthy", why)
                self._save(st)
                raise BundleError(f"{reason}; rolled back to {good}, which is not healthy either: {why}")
        return {"result": "rolled back", "version": good, "failed": bad, "reason": reason}

    def _recover(self, activate: Activator | None) -> dict[str, Any] | None:
        """Finish what a killed command left: a pending switch is redone and health-checked."""
        st = self.state()
        pending = st.get("pending")
        if not pending:
            return None
        if not (self.versions / pending / ".complete").is_file():
            st["pending"] = None
            self._event(st, pending, "abandoned", "staging did not complete")
            self._save(st)
            return None
        if self.link_target("current") != pending:
            self._switch(pending, self.link_target("current"))  # killed before the switch: redo it
        return self._health(activate)

    def recover(self, activate: Activator | None) -> dict[str, Any] | None:
        with self._locked():
            return self._recover(activate)

    def commit(self) -> dict[str, Any]:
        with self._locked():
            return self._commit()

    def rollback(self, activate: Activator | None, reason: str = "requested by operator") -> dict[str, Any]:
        with self._locked():
            return self._rollback(activate, reason)

    def _prune(self) -> None:
        protect = {self.link_target("current"), self.link_target("previous"), self.state().get("pending")}
        done = sorted((d for d in self.versions.iterdir() if (d / ".complete").is_file()),
                      key=lambda d: d.stat().st_mtime, reverse=True)
        for d in done[self.keep:]:
            if d.name not in protect:
                shutil.rmtree(d, ignore_errors=True)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".") if p.isdigit())
