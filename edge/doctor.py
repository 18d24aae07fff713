"""`edge doctor`: check what a start needs, and say in plain words what to fix.

Runs on any machine: no llama.cpp, TensorRT or GPU needed. Each check returns ok / warn / fail
with a sentence and, where something is wrong, the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge.config import BUILTIN_PREFIX, Config, cache_dir, find_config, load_config, state_dir, write_probe
from edge.errors import ConfigError, EdgeError

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # "ok" | "warn" | "fail"
    message: str
    fix: str = ""


def _config(path: str | None) -> tuple[Config | None, Check]:
    found = find_config(path)
    try:
        cfg = load_config(found)
    except ConfigError as exc:
        return None, Check("config", "fail", str(exc), "correct the field named above")
    where = found or "no config file: the embedded default model"
    served = [m.name for m in cfg.models] + [e.name for e in cfg.engines]
    return cfg, Check("config", "ok", f"valid ({where}); serves: {', '.join(served)}")


def _model_files(cfg: Config) -> list[Check]:
    from edge.gguf import read_gguf_info

    checks = []
    for m in cfg.models:
        if m.path.startswith(BUILTIN_PREFIX):
            target = cache_dir(cfg) / "models"
            present = any(target.glob("*.gguf")) if target.is_dir() else False
            checks.append(Check(f"model {m.name}", "ok",
                                f"{m.path}: " + ("assembled in " + str(target) if present else
                                                 "assembled and verified on first start")))
            continue
        try:
            info = read_gguf_info(m.path)
        except EdgeError as exc:
            checks.append(Check(f"model {m.name}", "fail", str(exc),
                                "point models.path at a complete GGUF file (re-copy it if truncated)"))
            continue
        checks.append(Check(f"model {m.name}", "ok", f"{m.path}: GGUF v{info.version}, "
                            f"{info.architecture}, {_mib(info.size)}, {info.tensor_count} tensors"))
    return checks


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 10 * 2**20 else f"{n / 2**20:.0f} MiB"


def _memlock(cfg: Config, unit_text: str | None) -> Check:
    from edge.mlock import memlock_verdict

    level, message, fix = memlock_verdict(cfg, unit_text)
    return Check("mlock", level, message, fix)


def _memory(cfg: Config) -> Check:
    from edge.mlock import models_bytes

    need = models_bytes(cfg)
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        avail = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return Check("memory", "warn", "cannot read MemAvailable from /proc/meminfo")
    msg = f"{_mib(avail)} available, models need {_mib(need)} plus KV cache"
    if avail < need:
        return Check("memory", "fail", msg, "use a smaller quantization or free memory")
    if avail < need * 1.25:
        return Check("memory", "warn", msg, "little headroom: lower n_ctx or stop other services")
    return Check("memory", "ok", msg)


def _units(unit_dirs: list[Path]) -> tuple[list[Check], str | None]:
    for d in unit_dirs:
        sock, svc = d / "edge.socket", d / "edge.service"
        if sock.is_file() and svc.is_file():
            text = svc.read_text()
            listen = re.findall(r"^ListenStream=(.+)$", sock.read_text(), re.M)
            return [Check("units", "ok", f"{sock} listens on {', '.join(listen)}; {svc} present")], text
    return [Check("units", "warn", "edge.socket / edge.service not installed in "
                  + ", ".join(map(str, unit_dirs)),
                  "edge units install && systemctl daemon-reload && systemctl enable --now edge.socket edge.service")], None


def _dirs(cfg: Config) -> list[Check]:
    # The same real write a start makes before loading (edge.config.check_writable).
    checks = []
    for name, d, what in (("state dir", state_dir(cfg), "start reports, OTA versions"),
                          ("cache dir", cache_dir(cfg), "engines, the assembled default model")):
        problem = write_probe(d)
        if problem:
            checks.append(Check(name, "fail", f"{d} is not writable: {problem} (a start exits 78)",
                                "under systemd, StateDirectory=/CacheDirectory= create it; from a "
                                "shell set paths.state_dir / paths.cache_dir"))
        else:
            checks.append(Check(name, "ok", f"{d} is writable ({what} go there)"))
    return checks


def _device() -> Check:
    from edge.device import detect

    d = detect()
    what = d.jetson_model or f"{d.cpu_arch} host"
    gpu = f"{d.sm} (from {d.sm_source})" if d.sm else "no GPU found"
    return Check("device", "ok", f"{what}; L4T {d.l4t_release or '-'}; GPU {gpu}; CUDA {d.cuda or '-'}; "
                 f"TensorRT {d.tensorrt or '-'}; ONNX Runtime {d.onnxruntime or '-'}")


def _engines(cfg: Config) -> list[Check]:
    if not cfg.engines:
        return []
    from edge.device import detect
    from edge.engines.serve import configured_engines

    checks = []
    for e, stored in configured_engines(cfg, detect()):
        if isinstance(stored, EdgeError):
            checks.append(Check(f"engine {e.name}", "fail", str(stored),
                                "build it for this key with `edge build-engine` or ship it in an OTA bundle"))
            continue
        checks.append(Check(f"engine {e.name}", "ok", f"{stored.path.name} matches this device "
                            f"({_mib(stored.bytes)}, built {stored.meta.get('created')} on "
                            f"{stored.meta.get('builder_host')})"))
    return checks


def run_checks(config: str | None, unit_dirs: list[Path]) -> list[Check]:
    cfg, first = _config(config)
    checks = [first]
    if cfg is None:
        return checks
    unit_checks, unit_text = _units(unit_dirs)
    steps: list[Callable[[], list[Check]]] = [
        lambda: [_device()],
        lambda: _model_files(cfg),
        lambda: _engines(cfg),
        lambda: [_memlock(cfg, unit_text)],
        lambda: [_memory(cfg)],
        lambda: unit_checks,
        lambda: _dirs(cfg),
    ]
    for step in steps:
        checks += step()
    return checks
