"""Every error edge raises on purpose, with the exit code it ends a command with.

    EdgeError                     70  anything else (a restart may help); also any unexpected
                                      exception, at the CLI boundary (its traceback logged once)
    ├── ConfigError               78  the config file, or one field of it, is invalid
    ├── ModelError                65  a model file is missing, truncated, not GGUF, or fails its sha256
    ├── EngineError               65  no engine for this device's key, or it fails its sha256
    │   ├── CudaError             65  a CUDA driver call failed (edge.device.cuda): the call, the
    │   │   │                         CUresult's name, for cuInit what it most often means
    │   │   └── ContextLost       70  ...with a sticky error (also a GpuContextLost)
    │   ├── DriverMissing         65  cuda-python is there, the driver library libcuda.so.1 is not
    │   └── GpuContextLost        70  a sticky CUDA error (illegal address, launch failure, ECC...):
    │                                 the process's CUDA context is lost; only a restart recovers
    ├── MlockError                77  require_mlock = true and the lock did not take
    ├── GpuOffloadUnavailable     78  n_gpu_layers set, and llama.cpp has no GPU (a CPU-only build,
    │                                 or a CUDA build whose device did not start: the driver's reason)
    ├── MissingDependency         69  a needed package is not installed (names a real extra)
    ├── ServiceUnreachable        69  no edge service answers on the control socket (edge reload,
    │                                 an OTA activation by reload): nothing was switched
    ├── BackendError              70  a native backend (llama.cpp, TensorRT) failed
    ├── WarmupError               70  a warm-up request failed: not fit to serve
    ├── SafeModeExhausted         76  the same phase crashed twice in a row with its last safe
    │                                 fallback too (edge.lifecycle.safemode): no restart helps
    ├── StoppedDuringStart         0  SIGTERM before READY: nothing was accepted, exit cleanly
    └── RequestError             (HTTP 4xx/5xx, never an exit) a client request is invalid

Exit codes follow sysexits(3) so that the unit's RestartPreventExitStatus= can stop restart
loops for errors a restart cannot fix (bad config, bad model file, mlock refused).
Optional packages are imported through `require()`, the one place an ImportError becomes an
error that names the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

__all__ = [
    "EX_CONFIG",
    "EX_SAFE_MODE_EXHAUSTED",
    "EX_DATAERR",
    "EX_NOPERM",
    "EX_OK",
    "EX_SOFTWARE",
    "EX_UNAVAILABLE",
    "EXIT_CODES",
    "JETPACK_TRT",
    "EdgeError",
    "ConfigError",
    "ModelError",
    "EngineError",
    "CudaError",
    "ContextLost",
    "DriverMissing",
    "GpuContextLost",
    "MlockError",
    "GpuOffloadUnavailable",
    "MissingDependency",
    "ServiceUnreachable",
    "BackendError",
    "WarmupError",
    "SafeModeExhausted",
    "StoppedDuringStart",
    "RequestError",
    "require",
]

EX_OK = 0
EX_SOFTWARE = 70  # internal error: a restart may help
EX_UNAVAILABLE = 69  # a dependency (package, socket) is missing
EX_DATAERR = 65  # a model file is missing, truncated or not what it claims
EX_NOPERM = 77  # mlock required but refused by RLIMIT_MEMLOCK
EX_CONFIG = 78  # the config file is missing or invalid
EX_SAFE_MODE_EXHAUSTED = 76  # every safe fallback of a crashing phase crashed too (not a sysexits code's sense)


class EdgeError(Exception):
    """Base of every error edge raises on purpose; `exit_code` is what `edge serve` exits with."""

    @property
    def exit_code(self) -> int:
        return next(code for cls, code in EXIT_CODES.items() if isinstance(self, cls))


class ConfigError(EdgeError):
    """The config file, or one field of it, is not what edge expects."""

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = field
        self.message = message
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {message}")


class ModelError(EdgeError):
    """A model file is missing, truncated, not GGUF, or fails its checksum."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class EngineError(EdgeError):
    """An engine is missing for this device, was built for another one, or fails its checksum."""


class GpuContextLost(EngineError):
    """A CUDA call returned an error that leaves the process's CUDA context unusable (the driver's
    "sticky" errors: every later call returns the same error until the process exits). The
    service stops taking work and exits 70, which the unit restarts (edge.device.cuda says which
    errors these are)."""


class CudaError(EngineError):
    """A CUDA driver call returned an error: the call, the CUresult's name, and `why` (what it
    most often means, edge.device.cuda.hint) where there is one."""

    def __init__(self, call: str, name: str, why: str = "") -> None:
        self.call, self.name = call, name
        super().__init__(f"CUDA {call} failed: {name}" + (f" ({why})" if why else ""))


class ContextLost(CudaError, GpuContextLost):
    """A sticky error (edge.device.cuda.STICKY_ERRORS): this process's CUDA context is unusable
    from now on."""


class DriverMissing(EngineError):
    """cuda-python is installed but the NVIDIA driver library (libcuda.so.1) cannot be loaded."""

    def __init__(self, detail: str) -> None:
        super().__init__("the NVIDIA driver library libcuda.so.1 cannot be loaded, so no CUDA call can "
                         "run (install the NVIDIA driver; on a Jetson it comes with JetPack's "
                         f"nvidia-l4t-cuda): {' '.join(detail.split())}")


class MlockError(EdgeError):
    """The model could not be locked in RAM and the config requires it."""


class GpuOffloadUnavailable(EdgeError):
    """A model asks for n_gpu_layers, and the installed llama.cpp cannot offload: a restart cannot
    fix either cause (a CPU-only build, or a device the unit or driver keeps closed), so the unit
    stops instead of looping. The message (edge.model.gpu) says which cause and the fix."""


# Where TensorRT comes from on a Jetson (no pip wheel there): docs/install.md, "Installing the GPU path".
JETPACK_TRT = "on a Jetson: JetPack's python3-libnvinfer, seen by a venv made with --system-site-packages"


class MissingDependency(EdgeError):
    """A package is not installed; the message names the extra that brings it (None: a core
    dependency of edge itself, so the install is broken)."""

    def __init__(self, package: str, extra: str | None, purpose: str) -> None:
        self.package = package
        self.extra = extra
        # Never `pip install edge[...]`: PyPI's `edge` is another project. The extra comes from
        # edge's own checkout or wheel (docs/install.md, "Extras").
        fix = (f"install edge's {extra!r} extra from its checkout or wheel, e.g. pip install '/opt/edge[{extra}]'"
               if extra else "reinstall edge from its checkout or wheel (scripts/setup)")
        super().__init__(f"{purpose} needs the Python package {package!r}, which is not installed: {fix}")


class ServiceUnreachable(EdgeError):
    """No running service answers on the control socket: a reload (or an OTA activation by
    reload) is refused before anything is switched."""


class BackendError(EdgeError):
    """A native backend (llama.cpp, TensorRT) failed; translated from its own exception."""


class WarmupError(EdgeError):
    """A warm-up request failed: the model is not fit to serve."""


class SafeModeExhausted(EdgeError):
    """A phase crashed twice in a row under the same key after its last safe fallback (or it has
    none): starting again would crash again. The unit does not restart on it."""


class StoppedDuringStart(EdgeError):
    """SIGTERM arrived before the service was ready: nothing was accepted, so exit cleanly."""


class RequestError(EdgeError):
    """A client request is invalid; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str = "invalid_request_error") -> None:
        self.status = status
        self.param = param
        self.code = code
        super().__init__(message)


# The one table: most specific class first; EdgeError last catches the rest.
EXIT_CODES: dict[type[EdgeError], int] = {
    ConfigError: EX_CONFIG,
    ModelError: EX_DATAERR,
    GpuContextLost: EX_SOFTWARE,
    EngineError: EX_DATAERR,
    MlockError: EX_NOPERM,
    GpuOffloadUnavailable: EX_CONFIG,
    MissingDependency: EX_UNAVAILABLE,
    SafeModeExhausted: EX_SAFE_MODE_EXHAUSTED,
    ServiceUnreachable: EX_UNAVAILABLE,
    StoppedDuringStart: EX_OK,
    EdgeError: EX_SOFTWARE,
}


def require(module: str, extra: str | None, purpose: str, *, package: str | None = None,
            importer: Callable[[], ModuleType] | None = None) -> ModuleType:
    """Import `module` (by `importer` where given) or raise MissingDependency naming the pip
    `package` and the `extra` of edge that brings it (extras are those of pyproject.toml:
    default-model, ort, trt, bench; None for edge's own dependencies)."""
    try:
        return importer() if importer is not None else importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and not module.startswith(exc.name.split(".")[0]):
            raise  # the package is there but one of its own imports failed: show that
        raise MissingDependency(package or module.split(".")[0], extra, purpose) from None
