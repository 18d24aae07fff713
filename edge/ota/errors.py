"""OTA error classes (kept here so the installer imports nothing heavy; edge.errors holds the base,
and ServiceUnreachable, which `edge reload` raises too)."""

from __future__ import annotations

from edge.errors import EdgeError, ServiceUnreachable

__all__ = ["BundleError", "VersionError", "PolicyError", "OtaStateError", "OtaIOError", "OtaBusy",
           "ServiceUnreachable", "RolledBackUnhealthy", "RepairedUnhealthy"]


class BundleError(EdgeError):
    """A bundle is unsigned, wrongly signed, malformed, or fails a file's checksum."""

    exit_code = 65


class VersionError(BundleError):
    """A version string outside the grammar (empty, path-like, or not MAJOR.MINOR.PATCH)."""


class PolicyError(BundleError):
    """A validly signed bundle the update policy refuses: downgrade, replay, changed content."""


class OtaStateError(EdgeError):
    """The device's OTA state cannot be written: a full file system (before its slots existed, or
    an operation that needs room); the message names the file and the state the command left."""

    exit_code = 75  # EX_TEMPFAIL: it works again once space is freed


class OtaIOError(EdgeError):
    """The file system failed an OTA command otherwise than by being full (EIO, a read-only file
    system): the message names the file, and what the command did stands (`edge ota status` shows
    it). (An answer stdout cannot take is 74 too: edge.cli.output, for every command.)"""

    exit_code = 74  # EX_IOERR


class OtaBusy(EdgeError):
    """Another `edge ota` command holds the lock: try again when it is done."""

    exit_code = 75  # EX_TEMPFAIL


class RolledBackUnhealthy(EdgeError):
    """A version was rolled back, and the one it went back to fails its health check too: the
    device serves nothing healthy. Exit 1, as every rollback; the message says both reasons."""

    exit_code = 1


class RepairedUnhealthy(EdgeError):
    """The current version's bundle pushed again repaired files the service reads, and the service
    activated on them fails its health check: the version stays (there is nothing to roll back:
    it was current before). Exit 1, as an install that did not end healthy."""

    exit_code = 1
