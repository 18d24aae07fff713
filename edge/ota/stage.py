"""Staging one version: versions/.staging-V-PID is filled (every file a hard link into the
content store, edge.toml, the signed manifest and its signature, the version's own link, its
sampled hashes for the boot's check, the .complete marker), fsynced, and renamed to versions/V. Until that rename it is garbage that
recover deletes; any failure on the way (a full file system, blocks or inodes: exit 75, try again
once space is freed; a file that fails its check: 65) deletes it and is one clear line: the
installed version is untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from edge.ota.bundle import Bundle
from edge.ota.audit import write_sampled
from edge.ota.errors import BundleError, OtaStateError
from edge.ota.fsops import Fs
from edge.ota.links import HOME
from edge.ota.statefile import write_marker
from edge.ota.store import Store

__all__ = ["stage"]


def stage(versions: Path, store: Store, fs: Fs, bundle: Bundle, floor: str | None) -> dict[str, Any]:
    """Stage `bundle` as versions/<V> (not there yet: a version on disk is checked by
    edge.ota.recheck instead); what was written, reused and copied (links impossible). `floor`:
    the highest version committed so far, which the new marker carries."""
    from edge.ota.extract import check_free_space, extract_files

    final = versions / bundle.version  # validated: no path characters, not empty
    check_free_space(bundle, store, versions)
    if os.path.lexists(final):
        fs.rmtree(final)  # incomplete, never linked
    staging = versions / f".staging-{bundle.version}-{os.getpid()}"
    try:
        fs.mkdir(staging)
        done = extract_files(bundle, staging, store, fs)
        for name, data in (("edge.toml", bundle.manifest["config"].encode()),
                           ("manifest.json", bundle.raw_manifest), ("manifest.sig", bundle.signature)):
            fs.write_file(staging / name, data)
        fs.symlink(f"versions/{bundle.version}", staging / HOME)
        write_sampled(fs, staging, bundle.files)  # what a boot checks of it (edge.ota.audit)
        write_marker(fs, staging, bundle.version, floor)
        for d in sorted((p for p in staging.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
            fs.fsync_dir(d)
        fs.fsync_dir(staging)
        fs.replace(staging, final)
        fs.fsync_dir(versions)
    except OSError as exc:
        fs.rmtree(staging)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # it works once space is freed: 75
            raise OtaStateError(_why(bundle, staging, exc)) from None
        raise BundleError(_why(bundle, staging, exc)) from None
    except BaseException:
        fs.rmtree(staging)
        raise
    if not done["copied"]:
        del done["copied"]
    return done


def _why(bundle: Bundle, staging: os.PathLike[str], exc: OSError) -> str:
    where = exc.filename or staging
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(bundle_dir := os.path.dirname(staging)).free
        inodes = os.statvfs(bundle_dir).f_favail
        return (f"{bundle.path}: the file system is full (blocks or inodes: {free} bytes and {inodes} "
                f"inodes free) while writing {where}; nothing of version {bundle.version} was kept and "
                "the installed version is untouched (free space, or lower [ota] keep_versions)")
    return (f"{bundle.path}: cannot write {where} ({exc.strerror}); nothing of version "
            f"{bundle.version} was kept and the installed version is untouched")
