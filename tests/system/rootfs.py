"""A minimal Debian rootfs for the system suite, built once with mmdebstrap and cached.

The cache key is the package list and the suite: change either and a new tree is built beside
the old one (the old one is removed once the new one is complete). The tree is written to a
temporary directory and renamed into place, so a build cut short is never reused.

Run as a script (`python tests/system/rootfs.py`) to build it ahead of the tests and print how
long it took.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUITE = "bookworm"  # systemd 252 and Python 3.11, like the host the wheels are built on
# systemd-sysv gives /sbin/init for `systemd-nspawn -b`; dbus for systemctl/machine registration;
# iproute2 for `ss -ltn`; libgomp1 for llama.cpp's OpenMP; procps for ps/pgrep while debugging.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "iproute2", "libgomp1",
            "procps", "ca-certificates")
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "system"


def cache_key() -> str:
    text = SUITE + "\n" + "\n".join(sorted(PACKAGES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rootfs_path() -> Path:
    return CACHE / f"rootfs-{SUITE}-{cache_key()}"


def build_rootfs(log: Path | None = None) -> Path:
    """Return the cached rootfs, building it first when it is not there."""
    target = rootfs_path()
    if (target / "usr" / "lib" / "systemd" / "systemd").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = ["mmdebstrap", "--variant=minbase", "--mode=root", "--include=" + ",".join(PACKAGES),
           # the machine id is made at first boot; an empty one makes nspawn pick a fresh one
           "--customize-hook=rm -f \"$1/etc/machine-id\"; touch \"$1/etc/machine-id\"",
           SUITE, str(tmp)]
    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"mmdebstrap failed (exit {r.returncode}); see {log}")
    tmp.rename(target)
    for old in CACHE.glob(f"rootfs-*"):
        if old != target and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return target


if __name__ == "__main__":
    t0 = time.monotonic()
    path = build_rootfs(CACHE / "mmdebstrap.log")
    print(f"{path}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
