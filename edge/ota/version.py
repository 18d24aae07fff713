"""Bundle versions: one grammar, one ordering. A version names a directory under versions/, so
it is validated before anything uses it as a path (an empty or path-like version could name,
and then delete, a directory outside the OTA tree).

Grammar (SemVer 2.0 without build metadata): MAJOR.MINOR.PATCH[-PRE], numbers without leading
zeros and of any length (SemVer caps none: 1.0.2026120301 is a version), PRE dot-separated
identifiers of [0-9A-Za-z-], at most 64 characters in all.
Ordering is SemVer's: numbers numerically; a pre-release sorts before its release; pre-release
identifiers compare numerically when both are numbers, numbers before words, else as ASCII.
Two versions that compare equal are the same string.
"""

from __future__ import annotations

import re
from functools import total_ordering

from edge.ota.errors import VersionError

__all__ = ["Version", "parse_version", "parsed", "highest", "GRAMMAR"]

GRAMMAR = "MAJOR.MINOR.PATCH[-PRERELEASE] (e.g. 1.4.0 or 1.5.0-rc.1)"
_NUM = r"(?:0|[1-9][0-9]*)"
_ID = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_RE = re.compile(rf"({_NUM})\.({_NUM})\.({_NUM})(?:-({_ID}(?:\.{_ID})*))?")
MAX_LEN = 64


@total_ordering
class Version:
    """A validated version; str(v) is the exact text it was parsed from."""

    def __init__(self, text: str, core: tuple[int, int, int], pre: tuple[str, ...]) -> None:
        self.text, self.core, self.pre = text, core, pre

    def _key(self) -> tuple:
        # a release sorts after all its pre-releases; numeric identifiers sort before words
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.core, not self.pre, pre)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self._key() == other._key()

    def __lt__(self, other: "Version") -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self.text)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Version({self.text!r})"


def parse_version(text: object, what: str = "bundle_version") -> Version:
    """The one validator: build, inspect and install all go through it."""
    if not isinstance(text, str) or not text:
        raise VersionError(f"{what} {text!r} is empty or not a string: expected {GRAMMAR}")
    m = _RE.fullmatch(text) if len(text) <= MAX_LEN else None  # bounded before the regex runs
    if m is None:
        raise VersionError(f"{what} {text!r} is not a version: expected {GRAMMAR}, at most "
                           f"{MAX_LEN} characters, no path characters")
    core = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return Version(text, core, tuple(m.group(4).split(".")) if m.group(4) else ())


def parsed(text: object) -> Version | None:
    """A version recorded by an edge before the grammar existed (or none) does not order: None."""
    try:
        return parse_version(text)
    except VersionError:
        return None


def highest(*texts: object) -> str | None:
    """The highest of these versions (those outside the grammar skipped); None when none orders."""
    found = [v for v in map(parsed, texts) if v is not None]
    return str(max(found)) if found else None
