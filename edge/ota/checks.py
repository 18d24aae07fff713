"""What is checked before anything is written. `check_bundle`: what depends on the bundle alone
(the edge version it needs, a config that parses, every relative file it names listed in the
manifest): `edge ota inspect` and `edge ota install` run the same checks, so a bundle gets one
verdict and one exit code from both. `check_device`: files it names by absolute path on this
device, and an engine for this device's key (install only)."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any

from edge.ota.bundle import Bundle
from edge.ota.errors import BundleError

__all__ = ["check_bundle", "check_device", "check_engines", "check_edge_version", "unlisted"]


def check_edge_version(bundle: Bundle) -> None:
    from edge import __version__
    from edge.ota.version import parse_version

    need = parse_version(bundle.manifest.get("min_edge_version", "0.0.0"), "min_edge_version")
    if need > parse_version(__version__, "edge version"):
        raise BundleError(f"{bundle.path}: needs edge >= {need}, this is {__version__}")


def _config(bundle: Bundle) -> Any:
    from edge.config import parse_config
    from edge.errors import ConfigError

    try:
        return parse_config(bundle.manifest["config"], source=f"{bundle.path}: config")
    except ConfigError as exc:
        raise BundleError(str(exc)) from None


def _refs(cfg: Any) -> list[tuple[str, str, str]]:
    """(config field, what, path) for every model, adapter and recipe file the config names."""
    from edge.config import BUILTIN_PREFIX

    refs = [(f"models[{i}].path", f"model {m.name!r}", m.path) for i, m in enumerate(cfg.models)
            if not m.path.startswith(BUILTIN_PREFIX)]
    refs += [(f"models[{i}].adapters[{j}].path", f"adapter {a.name!r} of model {m.name!r}", a.path)
             for i, m in enumerate(cfg.models) for j, a in enumerate(m.adapters)]
    return refs + [(f"engines[{i}].recipe", f"recipe of engine {e.name!r}", e.recipe)
                   for i, e in enumerate(cfg.engines) if e.recipe]


def unlisted(bundle: Bundle) -> list[tuple[str, str, str]]:
    """(config field, what, path) of every relative file the config uses that the bundle's
    manifest does not list."""
    listed = {f.path for f in bundle.files}
    return [r for r in _refs(_config(bundle)) if not os.path.isabs(r[2]) and posixpath.normpath(r[2]) not in listed]


def check_bundle(bundle: Bundle) -> None:
    """Name every relative file the config uses that the bundle's manifest does not list."""
    check_edge_version(bundle)
    missing = [f"{what}: {path}" for _, what, path in unlisted(bundle)]
    if missing:
        raise BundleError(f"{bundle.path}: its config references files the bundle does not carry "
                          f"(nor lists): {'; '.join(missing)}")


def check_device(bundle: Bundle, device: Any) -> None:
    """Files the config names by absolute path must be on this device; engines for its key."""
    cfg = _config(bundle)
    missing = [f"{what}: {path}" for _, what, path in _refs(cfg) if os.path.isabs(path) and not Path(path).is_file()]
    if missing:
        raise BundleError(f"{bundle.path}: its config references files outside the bundle that this "
                          f"device does not have: {'; '.join(missing)}")
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
