"""What install checks before it writes anything: the bundle's config must only reference files
the bundle carries (or that are on this device), and an engine for this device's key."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any

from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError

__all__ = ["check_references", "check_engines", "check_edge_version"]


def check_edge_version(bundle: Bundle) -> None:
    from edge import __version__
    from edge.ota.version import parse_version

    need = parse_version(bundle.manifest.get("min_edge_version", "0.0.0"), "min_edge_version")
    if need > parse_version(__version__, "edge version"):
        raise BundleError(f"{bundle.path}: needs edge >= {need}, this is {__version__}")


def _missing(path: str, carried: set[str]) -> bool:
    if os.path.isabs(path):
        return not Path(path).is_file()  # a device-resident file, outside the bundle
    return posixpath.normpath(path) not in carried


def check_references(bundle: Bundle, device: Any) -> None:
    """Name every model and recipe the config uses that the bundle does not carry."""
    from edge.config import BUILTIN_PREFIX, parse_config

    cfg = parse_config(bundle.manifest["config"], source=f"{bundle.path}: config")
    carried = {f.path for f in bundle.files}
    missing = [f"model {m.name!r}: {m.path}" for m in cfg.models
               if not m.path.startswith(BUILTIN_PREFIX) and _missing(m.path, carried)]
    missing += [f"recipe of engine {e.name!r}: {e.recipe}" for e in cfg.engines
                if e.recipe and _missing(e.recipe, carried)]
    if missing:
        raise BundleError(f"{bundle.path}: its config references files the bundle does not carry "
                          f"(and this device does not have): {'; '.join(missing)}")
    if cfg.engines and device is not None:
        check_engines(bundle, cfg, device)


def check_engines(bundle: Bundle, cfg: Any, device: Any) -> None:
    """A bundle whose config serves engines must carry one for this device's key."""
    from edge.engines.key import EngineKey, key_for

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
