"""One exception tree for edge, with the exit code each error ends `edge serve` with.

Exit codes follow sysexits(3) so that the unit's RestartPreventExitStatus= can stop restart
loops for errors a restart cannot fix (bad config, bad model file, mlock refused).
"""

from __future__ import annotations

__all__ = [
    "EX_CONFIG",
    "EX_DATAERR",
    "EX_NOPERM",
    "EX_SOFTWARE",
    "EX_UNAVAILABLE",
    "EdgeError",
    "ConfigError",
    "ModelError",
    "EngineError",
    "MlockError",
    "MissingDependency",
    "BackendError",
    "RequestError",
]

EX_SOFTWARE = 70  # internal error: a restart may help
EX_UNAVAILABLE = 69  # a dependency (package, socket) is missing
EX_DATAERR = 65  # a model file is missing, truncated or not what it claims
EX_NOPERM = 77  # mlock required but refused by RLIMIT_MEMLOCK
EX_CONFIG = 78  # the config file is missing or invalid


class EdgeError(Exception):
    """Base of every error edge raises on purpose; `exit_code` is what `edge serve` exits with."""

    exit_code = EX_SOFTWARE


class ConfigError(EdgeError):
    """The config file, or one field of it, is not what edge expects."""

    exit_code = EX_CONFIG

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = field
        self.message = message
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {message}")


class ModelError(EdgeError):
    """A model file is missing, truncated, not GGUF, or fails its checksum."""

    exit_code = EX_DATAERR

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class EngineError(EdgeError):
    """An engine is missing for this device, was built for another one, or fails its checksum."""

    exit_code = EX_DATAERR


class MlockError(EdgeError):
    """The model could not be locked in RAM and the config requires it."""

    exit_code = EX_NOPERM


class MissingDependency(EdgeError):
    """An optional package is not installed; the message names the extra that brings it."""

    exit_code = EX_UNAVAILABLE

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(
            f"{purpose} needs the Python package {package!r}, which is not installed: "
            f"pip install 'edge[{extra}]'"
        )


class BackendError(EdgeError):
    """A native backend (llama.cpp, TensorRT) failed; translated from its own exception."""


class RequestError(EdgeError):
    """A client request is invalid; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str = "invalid_request_error") -> None:
        self.status = status
        self.param = param
        self.code = code
        super().__init__(message)
