"""TOML parsing on every supported Python: `tomllib` (3.11+) or its backport `tomli` (3.10, as
JetPack 6 ships). The one place edge imports a TOML parser."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib as _toml  # novermin (3.11+ only, behind the version check)
else:  # pragma: no cover - exercised by the Python 3.10 CI check
    import tomli as _toml

__all__ = ["TOMLDecodeError", "loads"]

TOMLDecodeError = _toml.TOMLDecodeError
loads = _toml.loads
