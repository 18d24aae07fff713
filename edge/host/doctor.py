"""`edge doctor`: check what a start needs, and say in plain words what to fix.

Runs on any machine: no llama.cpp, TensorRT or GPU needed. Each check returns ok / warn / fail
with a sentence and, where something is wrong, the fix.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge.config import Config, cache_dir, find_config, load_config, state_dir, write_probe
from edge.errors import ConfigError, EdgeError
from edge.model.mlock import mib

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # "ok" | "warn" | "fail"
    message: str
    fix: str = ""


def _config(path: str | None, origin: str = "") -> tuple[Config | None, Check]:
    found = find_config(path)
    try:
        cfg = load_config(found)
    except ConfigError as exc:
        fix = "correct the field named above"
        if "does not exist" in str(exc):
            fix = "create it (`edge units install` writes a starter config where none exists)"
        return None, Check("config", "fail", str(exc) + origin, fix)
    where = found or "no config file: the embedded default model"
    served = [m.name for m in cfg.models] + [e.name for e in cfg.engines]
    return cfg, Check("config", "ok", f"valid ({where}){origin}; serves: {', '.join(served)}")


def unit_config(unit_text: str) -> str | None:
    """The --config the unit's ExecStart= passes to `edge serve`, if any."""
    m = re.search(r"^ExecStart=(.+)$", unit_text, re.M)
    if not m:
        return None
    args = shlex.split(m.group(1).lstrip("-@:+!"))
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _model_files(cfg: Config) -> list[Check]:
    """Each model's file, context and slots, KV cache and embeddings context (doctor_models)."""
    from edge.host.doctor_models import model_checks

    return [Check(*c) for c in model_checks(cfg)]


_CAP_SYS_RESOURCE = 24


def _limit_bytes(value: str) -> int | None:
    """LimitMEMLOCK= value (soft[:hard], K/M/G/T suffixes) as bytes of the soft limit; None = infinity."""
    from edge.host.doctor_memory import unit_bytes

    soft = value.split(":")[0].strip()
    if not soft or soft.endswith("%"):
        raise ValueError(value)
    return unit_bytes(soft)


def _show(s: int | None) -> str:
    return "infinity" if s is None else mib(s)


def _running_limit() -> tuple[int, int | None] | None:
    """(pid, soft RLIMIT_MEMLOCK) of the running edge.service, None if it is not running."""
    import subprocess

    try:
        r = subprocess.run(["systemctl", "show", "--property=MainPID", "--value", "edge.service"],
                           capture_output=True, text=True, timeout=10)
        pid = int(r.stdout.strip() or 0)
        limits = Path(f"/proc/{pid}/limits").read_text() if pid else ""
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    m = re.search(r"^Max locked memory\s+(\S+)", limits, re.M)
    if not m:
        return None
    return pid, None if m.group(1) == "unlimited" else int(m.group(1))


def _pid1_can_raise(need: int) -> str | None:
    """Why systemd (PID 1) cannot give a service `need` bytes of MEMLOCK, or None if it can."""
    try:
        status = Path("/proc/1/status").read_text()
        limits = Path("/proc/1/limits").read_text()
    except OSError:
        return None
    cap = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)
    hard = re.search(r"^Max locked memory\s+\S+\s+(\S+)", limits, re.M)
    if not cap or not hard or int(cap.group(1), 16) >> _CAP_SYS_RESOURCE & 1:
        return None
    if hard.group(1) == "unlimited" or int(hard.group(1)) >= need:
        return None
    return (f"PID 1 lacks CAP_SYS_RESOURCE and its own hard RLIMIT_MEMLOCK is {mib(int(hard.group(1)))} "
            "(a container?), so systemd cannot raise LimitMEMLOCK=")


def _memlock_unit(need: int, unit_text: str) -> Check:
    """What the unit asks for, what systemd can give, and — if it runs — what the service got."""
    m = re.search(r"^LimitMEMLOCK=(.+)$", unit_text, re.M)
    fix = "set LimitMEMLOCK=infinity in [Service] (edge units install does)"
    try:
        asked = _limit_bytes(m.group(1)) if m else 8 * 2**20  # systemd's DefaultLimitMEMLOCK
    except ValueError:
        return Check("mlock", "fail", f"edge.service: LimitMEMLOCK={m.group(1)} is not a size", fix)
    setting = f"LimitMEMLOCK={m.group(1)}" if m else "no LimitMEMLOCK= (systemd's default, 8 MiB)"
    running = _running_limit()
    if running is not None:
        pid, got = running
        msg = f"edge.service (pid {pid}) runs with RLIMIT_MEMLOCK {_show(got)} ({setting}); models need {mib(need)}"
        if got is None or got >= need:
            return Check("mlock", "ok", msg)
        why = _pid1_can_raise(need)
        return Check("mlock", "fail", msg + (f": {why}" if why else ""),
                     "give PID 1 CAP_SYS_RESOURCE / a higher hard limit" if why else fix)
    if asked is not None and asked < need:
        return Check("mlock", "fail", f"edge.service has {setting}; {mib(need)} of models need locking", fix)
    why = _pid1_can_raise(need)
    if why:
        return Check("mlock", "fail", f"edge.service has {setting}, but {why}",
                     "run edge on the host's systemd, or give the container CAP_SYS_RESOURCE")
    return Check("mlock", "ok", f"edge.service has {setting} for {mib(need)} of models "
                 "(from the unit's text: edge.service is not running, so the limit it gets is not verified)")


def _memlock(cfg: Config, unit_text: str | None) -> Check:
    from edge.model.mlock import memlock_verdict, models_bytes

    if unit_text is not None and any(m.use_mlock for m in cfg.models):
        return _memlock_unit(models_bytes(cfg), unit_text)
    level, message, fix = memlock_verdict(cfg)
    return Check("mlock", level, message, fix)


def _memory(cfg: Config, unit_text: str | None) -> Check:
    """The models' need against what a start may use (edge/host/doctor_memory.py): MemAvailable,
    the cgroup's room, edge.service's MemoryMax=/MemoryHigh= — the reading the reload's guard uses."""
    from edge.host.doctor_memory import memory_check, models_need

    return Check(*memory_check(models_need(cfg), unit_text))


def _units(unit_dirs: list[Path]) -> tuple[list[Check], str | None]:
    for d in unit_dirs:
        sock, svc = d / "edge.socket", d / "edge.service"
        if sock.is_file() and svc.is_file():
            from edge.host.units import with_drop_ins

            text = with_drop_ins(svc)  # `systemctl edit`'s drop-ins too: what systemd runs
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


def _gpu(cfg: Config, unit_text: str | None) -> list[Check]:
    """The device, where each CUDA number came from, a runtime newer than the driver, llama.cpp's
    offload and the unit's device policy (edge/host/doctor_gpu.py)."""
    from edge.device.identity import detect
    from edge.host.doctor_gpu import cuda_runtime_check, device_check, gpu_offload_checks, unit_device_checks
    from edge.model.gpu import llama_build

    d, build = detect(), llama_build()
    found = [device_check(d, build), cuda_runtime_check(d), *gpu_offload_checks(cfg, d, build)]
    if any(e.backend == "tensorrt" for e in cfg.engines) or any(m.n_gpu_layers for m in cfg.models):
        found += unit_device_checks(unit_text)
    return [Check(*f) for f in found if f is not None]


def _adapters(cfg: Config) -> list[Check]:
    from edge.host.doctor_adapters import adapter_checks

    return [Check(*c) for c in adapter_checks(cfg)]


def _llama_cpu(cfg: Config) -> list[Check]:
    """The CPU paths llama.cpp uses, those edge turned off and why, per model (doctor_cpu)."""
    from edge.host.doctor_cpu import cpu_checks
    from edge.model.cpupaths import llama_cpu

    return [Check(*c) for c in cpu_checks(cfg, llama_cpu())] if cfg.models else []


def _engines(cfg: Config) -> list[Check]:
    if not cfg.engines:
        return []
    from edge.device.identity import detect
    from edge.engines.lookup import configured_engines

    checks = []
    for e, stored in configured_engines(cfg, detect()):
        if isinstance(stored, EdgeError):
            fix = ("make the GPU usable first (the device check says what the driver reports)"
                   if "none could be used" in str(stored) else
                   "build it for this key with `edge build-engine` or ship it in an OTA bundle")
            checks.append(Check(f"engine {e.name}", "fail", str(stored), fix))
            continue
        checks.append(Check(f"engine {e.name}", "ok", f"{stored.path.name} matches this device "
                            f"({mib(stored.bytes)}, built {stored.meta.get('created')} on "
                            f"{stored.meta.get('builder_host')})"))
    return checks


def _safe_mode(cfg: Config) -> list[Check]:
    """Safe mode's steps in force (a warning each: the device serves without a path that
    faulted), else how many crashes are on record (edge.lifecycle.safemode, edge.fleet.crashes);
    a give-up (edge.fleet.giveup) fails."""
    from edge.fleet.crashes import recent_crashes
    from edge.fleet.giveup import GiveUp
    from edge.lifecycle.safemode import SafeMode

    folder = state_dir(cfg)
    steps = SafeMode.load(folder).describe()
    checks = [Check(f"safe mode {s['target']}", "warn", f"{s['fallback']} since {s['since']}: {s['reason']}",
                    "find the cause (`edge status` lists the crashes, `journalctl -u edge` has their stacks), "
                    "then `edge safe-mode clear`") for s in steps]
    give_up = GiveUp.load(folder)
    if give_up is not None and not give_up.retrying:
        when = give_up.as_dict()
        checks.insert(0, Check("given up", "fail", f"since {when['since']}: {give_up.reason}; every request is "
                               f"answered 503 until it ends (retry at {when['retry_at']})",
                               "fix the cause, then `edge safe-mode clear`: the next client starts the service, "
                               "no systemctl needed"))
    if not steps:
        crashes = recent_crashes(folder)
        last = crashes[-1] if crashes else None
        checks.append(Check("safe mode", "ok", "off" + (f"; last crash {last['at']} in {last['phase']} "
                                                      f"(signal {last['signal']})" if last else "; no crash on record")))
    return checks


def _access(cfg: Config, unit_dirs: list[Path], unit_text: str | None) -> list[Check]:
    """Who may use the service: listen addresses, API keys, TLS (edge/host/doctor_auth.py)."""
    from edge.host.doctor_auth import access_checks

    return [Check(*c) for c in access_checks(cfg, unit_dirs, unit_text)]


def _unit_files(cfg: Config, unit_text: str | None) -> list[Check]:
    """Every file the service opens, as the installed unit runs it (edge/host/doctor_sandbox.py)."""
    from edge.host.doctor_sandbox import sandbox_checks

    return [Check(*c) for c in sandbox_checks(cfg, unit_text)]


def _bytecode(cfg: Config) -> list[Check]:
    """Bytecode for every module a start imports: the unit (ProtectSystem=strict) can never write
    it, so a module without it is compiled from source at every start (edge.bytecode)."""
    from edge.bytecode import dependency_sources, edge_package, missing_bytecode, package_sources
    from edge.timing import UnreadableReport, read_last_report

    pkg = edge_package()
    own, deps = missing_bytecode(package_sources(pkg)), missing_bytecode(dependency_sources())
    try:
        last = (read_last_report(state_dir(cfg)) or {}).get("compiled") or []
    except UnreadableReport:
        last = []
    still = [c for c in last if Path(c).exists() and missing_bytecode([Path(c)])]
    fix = (f"compile at install, as the owner of the files: `edge units install`, or `{_python()} -m compileall "
           f"-q --invalidation-mode checked-hash {pkg}`")
    # a source checkout (edited as it runs) warns: scripts/setup compiles it, and an edit makes it stale
    level, fix = ("warn", "scripts/setup compiles a checkout") if (pkg.parent / ".git").exists() else ("fail", fix)
    if own:
        return [Check("bytecode", level, f"{len(own)} of edge's modules in {pkg} have no valid bytecode "
                      f"({_examples(own)}): every start compiles them from source", fix)]
    if still:
        return [Check("bytecode", level, f"the last start compiled {len(still)} source files that still have no "
                      f"valid bytecode ({', '.join(still[:3])})", fix.replace(str(pkg), "<their directory>"))]
    if deps:
        return [Check("bytecode", "warn", f"{len(deps)} modules of edge's dependencies have no valid bytecode "
                      f"({_examples(deps)}): a start that imports one compiles it", fix + "; for the dependencies: "
                      f"`{_python()} -m compileall -q <their site-packages directory>`")]
    return [Check("bytecode", "ok", f"edge's modules in {pkg} and its dependencies' have valid bytecode")]


def _examples(found: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{p}: {why}" for p, why in found[:2]) + ("; ..." if len(found) > 2 else "")


def _python() -> str:
    import sys

    return sys.executable


def run_checks(config: str | None, unit_dirs: list[Path]) -> list[Check]:
    """Check `config`, or — when none is given and edge.service is installed — the config the
    unit's ExecStart= runs, so that doctor tests what systemd will start."""
    unit_checks, unit_text = _units(unit_dirs)
    from_unit = unit_config(unit_text) if unit_text else None
    origin = ""
    if config is None and from_unit:
        config, origin = from_unit, " (the config edge.service runs: its ExecStart= --config)"
    elif config is not None and from_unit and Path(config).resolve() != Path(from_unit).resolve():
        unit_checks.append(Check("units", "warn", f"edge.service runs --config {from_unit}, not {config}",
                                 "run `edge doctor` without --config to check what the unit runs"))
    cfg, first = _config(config, origin)
    checks = [first]
    if cfg is None:
        return checks + unit_checks
    steps: list[Callable[[], list[Check]]] = [
        lambda: _gpu(cfg, unit_text),
        lambda: _model_files(cfg),
        lambda: _adapters(cfg),
        lambda: _llama_cpu(cfg),
        lambda: _engines(cfg),
        lambda: [_memlock(cfg, unit_text)],
        lambda: [_memory(cfg, unit_text)],
        lambda: unit_checks,
        lambda: _dirs(cfg),
        lambda: _safe_mode(cfg),
        lambda: _access(cfg, unit_dirs, unit_text),
        lambda: _unit_files(cfg, unit_text),
        lambda: _bytecode(cfg),
    ]
    for step in steps:
        checks += step()
    return checks
