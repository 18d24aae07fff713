"""`edge doctor`'s GPU checks: what the device is and where each CUDA number came from, a CUDA
runtime newer than the driver, llama.cpp's offload, and the unit's device policy.

The device policy is checked twice: on paper (every GPU node this machine has must be allowed by
the installed unit's DeviceAllow=, by path or by its driver's class; allowed nodes this machine
lacks are listed), and for real where it can be: a probe run by systemd with exactly the unit's
DevicePolicy=, DeviceAllow=, DynamicUser=, SupplementaryGroups= and Environment= (so that
CUDA_VISIBLE_DEVICES counts) goes as far as a service's first CUDA work through edge's own
driver boundary: cuInit, GPU 0's primary context retained and current, one byte allocated
(`systemd-run --pipe --wait`, root and a running systemd only; skipped with the reason
otherwise). On JetPack 6 cuInit passes without /dev/nvmap; the allocation does not.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edge.device.identity import DeviceInfo, version_tuple
from edge.host.gpu_nodes import GPU_NODE_GLOBS

if TYPE_CHECKING:
    from edge.config import Config

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]

__all__ = ["char_majors", "cuda_runtime_check", "device_check", "gpu_offload_checks", "probe_command", "unit_device_checks"]

PROBE = ("import json\nfrom edge.device.identity import probe_gpu\np = probe_gpu(work=True)\n"
         "print(json.dumps({'gpu': p.gpu.name if p.gpu else None, 'error': p.error}))")


def _check(name: str, level: str, message: str, fix: str = "") -> Check:
    return (name, level, message, fix)


def device_check(d: DeviceInfo, build: str | None) -> Check:
    what = d.jetson_model or f"{d.cpu_arch} host"
    gpu = f"{d.gpu_name or ''} {d.sm} (from {d.sm_source})".strip() if d.sm else "no GPU found"
    runtimes = ", ".join(f"{v} ({w})" for v, w in d.cuda_runtimes) or "none found"
    msg = (f"{what}; L4T {d.l4t_release or '-'}; GPU {gpu}; CUDA driver {d.cuda_driver or '-'} "
           f"(cuDriverGetVersion); CUDA runtimes: {runtimes}; engine key CUDA {d.cuda or '-'} (from "
           f"{d.cuda_source or '-'}); TensorRT {d.tensorrt or '-'}; ONNX Runtime {d.onnxruntime or '-'}; "
           f"llama.cpp build {build or '-'}")
    return _check("device", "ok", msg + (f"; no usable GPU: {d.gpu_error}" if d.gpu_error and not d.gpu_name else ""))


def cuda_runtime_check(d: DeviceInfo) -> Check | None:
    """A runtime newer than the driver: on a Jetson nothing runs (no forward compatibility); on a
    dGPU a newer minor of the same major runs (minor version compatibility), a newer major not."""
    if not d.cuda_driver or not d.cuda_runtimes:
        return None
    driver = version_tuple(d.cuda_driver)
    newer = [(v, w) for v, w in d.cuda_runtimes if version_tuple(v) > driver and
             (d.jetson or version_tuple(v)[:1] > driver[:1])]
    if not newer:
        return _check("cuda runtime", "ok", f"no CUDA runtime here is newer than the driver's CUDA {d.cuda_driver}")
    listing = ", ".join(f"{v} ({w})" for v, w in newer)
    why = ("a Jetson has no forward compatibility" if d.jetson else "a newer major than the driver never runs")
    pip = [w.split()[1] for _, w in newer if w.startswith("pip ")]
    fix = (f"pip install '{pip[0]}=={d.cuda_driver}.*' in edge's venv (or uninstall it: JetPack's runtime is "
           "/usr/local/cuda)" if pip and d.jetson else "install the runtime matching the driver, or a newer driver")
    return _check("cuda runtime", "fail", f"CUDA runtime {listing} is newer than the driver's CUDA "
                  f"{d.cuda_driver}: {why}, so TensorRT and ggml-cuda fail with cudaErrorInsufficientDriver", fix)


def gpu_offload_checks(cfg: Config, d: DeviceInfo, build: str | None) -> list[Check]:
    from edge.model.gpu import offload_problem

    asking = [m for m in cfg.models if m.n_gpu_layers]
    if not asking:
        return []
    if build == "cuda" and d.gpu_name:
        return [_check("gpu offload", "ok", f"llama.cpp is a CUDA build and the GPU answers; offloading "
                       f"{', '.join(m.name for m in asking)}")]
    m = asking[0]
    problem = offload_problem(build, m.name, m.n_gpu_layers, lambda: d.gpu_error or "no GPU found")
    if build == "cuda":
        return [_check("gpu offload", "fail", problem, "fix what the driver says (edge doctor's device "
                       "check and unit device policy), or set n_gpu_layers = 0")]
    from edge.model.gpu import CUDA_BUILD_FIX

    return [_check("gpu offload", "fail", problem.replace("this llama-cpp-python", f"this llama-cpp-python "
                   f"({build or 'missing'} build)", 1) + ": edge serve will refuse to start", CUDA_BUILD_FIX)]


def _allowed(unit_text: str) -> list[str]:
    return re.findall(r"^DeviceAllow=(\S+)", unit_text, re.M)


def char_majors(proc_devices: str) -> dict[str, set[int]]:
    """Driver name -> char majors, from /proc/devices."""
    out: dict[str, set[int]] = {}
    char = proc_devices.split("Block devices:")[0]
    for line in char.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.setdefault(parts[1], set()).add(int(parts[0]))
    return out


def _node_allowed(node: Path, name: str, allowed: list[str], majors: dict[str, set[int]]) -> bool:
    if name in allowed:
        return True
    try:
        major = os.major(node.stat().st_rdev)
    except OSError:
        return False
    return any(a.startswith("char-") and major in majors.get(a[5:], set()) for a in allowed)


def unit_device_checks(unit_text: str | None, dev: Path = Path("/dev"), proc_devices: Path = Path("/proc/devices"),
                       probe: bool = True) -> list[Check]:
    """Every GPU node here allowed by the unit, and (where it can run) a service's first CUDA work
    under its policy and environment."""
    if unit_text is None or "DevicePolicy=closed" not in unit_text:
        return []
    allowed = _allowed(unit_text)
    try:
        majors = char_majors(proc_devices.read_text())
    except OSError:
        majors = {}
    nodes = sorted({p for g in GPU_NODE_GLOBS for p in dev.glob(g) if p.is_char_device()})
    blocked = [f"/dev/{p.relative_to(dev)}" for p in nodes
               if not _node_allowed(p, f"/dev/{p.relative_to(dev)}", allowed, majors)]
    absent = [a for a in allowed if a.startswith("/dev/") and not (dev / a[5:]).exists()]
    note = f"; allowed but absent here (other platforms): {len(absent)}" if absent else ""
    if blocked:
        checks = [_check("unit devices", "fail", f"edge.service's DevicePolicy=closed blocks GPU nodes this "
                         f"machine has: {', '.join(blocked)}{note}", "edge units install (it allows this "
                         "device's nodes), then systemctl daemon-reload && systemctl restart edge.service")]
    else:
        checks = [_check("unit devices", "ok", f"edge.service allows every GPU node here ({len(nodes)} found)"
                         f"{note}")]
    return checks + ([_probe_under_policy(unit_text)] if probe else [])


def _environment(unit_text: str) -> list[str]:
    """NAME=VALUE of the unit's Environment= lines (several per line, quoted as systemd quotes
    them); an assignment with a %-specifier is left out (a transient unit would not expand it)."""
    found = []
    for line in re.findall(r"^Environment=(.*)$", unit_text, re.M):
        try:
            found += [a for a in shlex.split(line) if "=" in a and "%" not in a]
        except ValueError:
            continue
    return found


def probe_command(unit_text: str, run: str = "systemd-run") -> list[str]:
    """The transient service that does a service's first CUDA work under the unit's device policy,
    user, groups and environment."""
    groups = re.search(r"^SupplementaryGroups=(.+)$", unit_text, re.M)
    props = ["-p", "DevicePolicy=closed", "-p", "DynamicUser=yes", "-p", "NoNewPrivileges=yes",
             *[x for a in _allowed(unit_text) for x in ("-p", f"DeviceAllow={a} rw")],
             *(["-p", f"SupplementaryGroups={groups.group(1)}"] if groups else []),
             *[x for a in _environment(unit_text) for x in ("-E", a)],
             "-E", f"PYTHONPATH={Path(__file__).resolve().parents[2]}"]
    return [run, "--pipe", "--wait", "--quiet", "--collect", *props, sys.executable, "-c", PROBE]


def _probe_under_policy(unit_text: str) -> Check:
    run = shutil.which("systemd-run")
    if os.geteuid() != 0 or not run or not Path("/run/systemd/system").is_dir():
        return _check("unit cuda", "ok", "skipped: probing CUDA under the unit's device policy needs root "
                      "and a running systemd (systemd-run)")
    try:
        r = subprocess.run(probe_command(unit_text, run), capture_output=True, text=True, timeout=60)
        answer = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return _check("unit cuda", "warn", f"could not run the probe under the unit's device policy: {exc}")
    if answer.get("gpu"):
        return _check("unit cuda", "ok", f"under edge.service's device policy and environment: {answer['gpu']} "
                      "answers, its primary context is retained and one byte allocated")
    return _check("unit cuda", "warn" if "libcuda.so.1" in str(answer.get("error")) else "fail",
                  f"CUDA under edge.service's device policy and environment: {answer.get('error')}",
                  "allow the node the error names (edge units install renders this device's policy), "
                  "or fix the unit's Environment= (CUDA_VISIBLE_DEVICES)")
