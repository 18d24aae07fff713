"""Which CPU paths llama.cpp uses here, which ones edge turned off, and why.

What the library runs is asked of the library: `llama_print_system_info()` lists every backend
it registered with its compile-time features (`CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 | `;
`CUDA : ARCHS = 870 | ...` first on a CUDA build). It is called in a child process (`python -c`
and ctypes, tens of ms): loading the library runs its CPU probing, and a library built for
another CPU dies there (SIGILL); `edge device` and `edge doctor` say so instead of dying with it,
and never load llama.cpp into their own process.

The flags it was built with are known where scripts/setup installed it: setup records
scripts/build-llama-wheel's key and CMAKE_ARGS, with the sha256 of each library in the wheel, in
`<venv>/edge-llama-build.json` (`BUILD_RECORD`). The record counts only while the installed
libraries are the wheel's: a llama-cpp-python installed another way since is not described by it.

Paths edge turns off:
- AMX: scripts/build-llama-wheel leaves ggml's AMX path out (it faults on virtualized Sapphire
  Rapids, llama.cpp issue 20824); on a CPU with AMX, a build without it is reported with why.
- Extra buffer types, per model (`use_extra_bufts = false`, llama.cpp's --no-repack): no weight
  repacking and no AMX tiles for that model (edge/host/doctor_cpu.py names them).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

from edge.device.identity import cpu_flags
from edge.fsutil import atomic_write, sha256_file
from edge.model.gpu import llama_package_dir

__all__ = ["AMX_REASON", "AMX_RISK", "BUILD_RECORD", "BuildRecord", "effective_args", "LlamaCpu", "llama_cpu",
           "parse_system_info", "read_build_record", "record_build", "system_info"]

BUILD_RECORD = "edge-llama-build.json"  # in the venv (sys.prefix), written by scripts/setup
AMX_REASON = ("left out by scripts/build-llama-wheel: ggml's AMX path faults on virtualized Sapphire "
              "Rapids (llama.cpp issue 20824); EDGE_LLAMA_AMX=1 builds it")
AMX_RISK = ("this llama.cpp has ggml's AMX path and runs on a virtual machine: it faults there on "
            "Sapphire Rapids hosts at the first matrix multiply (llama.cpp issue 20824)")
CPU_AMX = ("amx_tile", "amx_int8")  # /proc/cpuinfo flags of the AMX ggml uses
PROBE = ("import ctypes, sys\nlib = ctypes.CDLL(sys.argv[1])\n"
         "lib.llama_print_system_info.restype = ctypes.c_char_p\n"
         "sys.stdout.write(lib.llama_print_system_info().decode(errors='replace'))\n")
Features = dict[str, dict[str, str]]  # backend ("CPU", "CUDA") -> feature -> value ("1", "870")


def parse_system_info(text: str) -> Features:
    """`CUDA : ARCHS = 870 | USE_GRAPHS = 1 | CPU : NEON = 1 | REPACK = 1 | ` as
    {"CUDA": {"ARCHS": "870", "USE_GRAPHS": "1"}, "CPU": {"NEON": "1", "REPACK": "1"}}."""
    backends: Features = {}
    current: dict[str, str] | None = None
    for item in (part.strip() for part in text.split("|")):
        if " : " in item:  # a backend's name starts its first feature
            name, _, item = item.partition(" : ")
            current = backends.setdefault(name.strip(), {})
        key, eq, value = item.partition("=")
        if current is not None and eq and key.strip():
            current[key.strip()] = value.strip()
    return backends


def libllama(package_dir: Path | None = None) -> Path | None:
    folder = package_dir or llama_package_dir()
    return next(iter(sorted(folder.rglob("libllama.so"))), None) if folder else None


def system_info(lib: Path, timeout: float = 60.0) -> tuple[str, str | None]:
    """(llama_print_system_info()'s text, None), or ("", why) where the library cannot be asked."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, str(lib)], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"cannot ask {lib}: {exc}"
    if r.returncode < 0:
        sig = signal.Signals(-r.returncode).name
        return "", (f"llama.cpp's library {lib} dies when it is loaded, by {sig} (a build for another "
                    "CPU?): rebuild it for this one (scripts/build-llama-wheel)")
    if r.returncode:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return "", f"cannot load {lib}: {last}"
    return r.stdout, None


@dataclass(frozen=True)
class BuildRecord:
    key: str  # scripts/build-llama-wheel's key (sha256 of version, arch, Python tag, flags)
    cmake_args: tuple[str, ...]
    path: str  # the record's file
    current: bool  # the installed libraries are the recorded wheel's

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "cmake_args": list(self.cmake_args), "record": self.path,
                "current": self.current}


def _wheel_libraries(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as z:
        return {Path(n).name: sha256(z.read(n)).hexdigest() for n in z.namelist()
                if n.startswith("llama_cpp/") and Path(n).name.endswith(".so")}


def record_build(wheel: Path, prefix: Path | None = None) -> Path:
    """What scripts/setup calls once it installed `wheel` (from build-llama-wheel's keyed dir,
    with its cmake-args.txt): the record of its key, flags and libraries, in the venv."""
    out = Path(prefix or sys.prefix) / BUILD_RECORD
    args = (wheel.parent / "cmake-args.txt").read_text().split()
    record = {"key": wheel.parent.name, "cmake_args": args, "wheel": wheel.name,
              "libraries": _wheel_libraries(wheel)}
    atomic_write(out, json.dumps(record, indent=1) + "\n")
    return out


def effective_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """The flags as CMake takes them: a switch given twice (EDGE_LLAMA_CMAKE_ARGS appends to
    build-llama-wheel's own, e.g. -DGGML_AVX512=OFF after its =ON) is its last value, in the
    place it first had."""
    last = {a.partition("=")[0]: a for a in args}
    return tuple(dict.fromkeys(last[a.partition("=")[0]] for a in args))


def read_build_record(prefix: Path | None = None, package_dir: Path | None = None) -> BuildRecord | None:
    """The record in the venv, if there is one; `current` checks every recorded library against
    the installed one (a llama-cpp-python installed since is another build)."""
    path = Path(prefix or sys.prefix) / BUILD_RECORD
    try:
        data = json.loads(path.read_text())
        key, args, libs = str(data["key"]), effective_args(tuple(map(str, data["cmake_args"]))), dict(data["libraries"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    folder = package_dir or llama_package_dir()
    installed = {p.name: p for p in sorted(folder.rglob("*.so"))} if folder else {}
    current = bool(libs) and all(n in installed and sha256_file(installed[n]) == h for n, h in libs.items())
    return BuildRecord(key, args, str(path), current)


@dataclass(frozen=True)
class LlamaCpu:
    """What `edge device` says of llama.cpp's CPU paths; `edge doctor` adds the models'."""

    backends: Features = field(default_factory=dict)
    error: str | None = None  # the library could not be asked (not installed, dies on load)
    build: BuildRecord | None = None
    turned_off: tuple[tuple[str, str], ...] = ()  # (path, why)
    amx_risk: bool = False  # the build has AMX and this is a virtual machine

    @property
    def cpu(self) -> dict[str, str]:
        return self.backends.get("CPU", {})

    def as_dict(self) -> dict[str, Any]:
        return {"backends": self.backends, "error": self.error,
                "build": self.build.as_dict() if self.build else None,
                "turned_off": [{"path": p, "reason": r} for p, r in self.turned_off],
                "amx_risk": AMX_RISK if self.amx_risk else None}

    def lines(self) -> list[str]:
        """The text of `edge device`: paths per backend, what is off and why, the build."""
        if self.error:
            return [self.error]
        out = [f"{name}: " + " ".join(k if v == "1" else f"{k}={v}" for k, v in feats.items())
               for name, feats in self.backends.items()]
        out += [f"turned off: {p}: {why}" for p, why in self.turned_off]
        out += [f"warning: {AMX_RISK}"] if self.amx_risk else []
        if self.build is None:
            out.append("build flags: not recorded (llama-cpp-python was not installed by scripts/setup)")
        elif not self.build.current:
            out.append(f"build flags: {self.build.path} describes another build (llama-cpp-python was "
                       "reinstalled since scripts/setup)")
        else:
            out.append(f"build: key {self.build.key}, " + " ".join(a for a in self.build.cmake_args
                                                                   if a.startswith("-DGGML_")))
        return out


def _turned_off(cpu: dict[str, str], flags: frozenset[str], build: BuildRecord | None) -> list[tuple[str, str]]:
    has_amx = [f for f in CPU_AMX if f in flags]
    if not has_amx or "AMX_INT8" in cpu:
        return []
    why = f"the CPU has {' '.join(has_amx)}, this build has no AMX path: "
    if build is not None and build.current and "-DGGML_AMX_INT8=OFF" in build.cmake_args:
        return [("AMX", why + AMX_REASON)]
    return [("AMX", why + "built without it (its build flags are not recorded here)")]


def llama_cpu(root: str | Path = "/", package_dir: Path | None = None,
              info: Callable[[Path], tuple[str, str | None]] = system_info,
              prefix: Path | None = None) -> LlamaCpu:
    """`root`: the tree /proc/cpuinfo is read from; `package_dir`: llama_cpp's installed folder;
    `info`: what the library says (tests pass a double of llama_print_system_info's text at this
    boundary); `prefix`: the venv holding the build record."""
    lib = libllama(package_dir)
    if lib is None:
        return LlamaCpu(error="llama-cpp-python is not installed (models need it; engines do not)")
    text, error = info(lib)
    if error:
        return LlamaCpu(error=error)
    backends, flags = parse_system_info(text), cpu_flags(root)
    build = read_build_record(prefix, package_dir)
    cpu = backends.get("CPU", {})
    return LlamaCpu(backends, None, build, tuple(_turned_off(cpu, flags, build)),
                    amx_risk="AMX_INT8" in cpu and "hypervisor" in flags)
