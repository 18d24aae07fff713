"""`edge doctor`'s memory check: the models' need against the memory a start may really use.

That is the smallest of: MemAvailable; the room under the limit of the cgroup the doctor runs in
(a container's limit holds the service too; edge.device.memory); and edge.service's own
`MemoryMax=`/`MemoryHigh=`, which systemd writes into the service's cgroup as memory.max/memory.high
— asked of systemd (`systemctl show`) when it runs, else read from the installed unit's text. When
a cgroup limit is what does not fit, the check names the setting and how to raise it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from edge.device.memory import MemoryReading, read_memory
from edge.model.mlock import mib

__all__ = ["Bound", "memory_check", "service_ceiling", "show_limits", "unit_bytes", "unit_limits"]

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]

UNIT_SETTINGS = ("MemoryMax", "MemoryHigh")  # systemd's names of memory.max and memory.high
_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}
SYSTEMD_RUNNING = Path("/run/systemd/system")  # sd_booted(3)


@dataclass(frozen=True)
class Bound:
    """One upper bound on what a start may use: bytes, what it is, and how to raise it."""

    room: int
    what: str
    fix: str


def unit_bytes(value: str, total: int | None = None) -> int | None:
    """A systemd size (bytes, K/M/G/T/P/E base 1024, or — with `total` — a percentage of it) as
    bytes; None for "infinity" (and for a percentage when `total` is not known). ValueError
    for anything else."""
    text = value.strip()
    if text in ("infinity", ""):
        return None
    pct = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
    if pct:
        return None if total is None else int(total * float(pct.group(1)) / 100)
    m = re.fullmatch(r"(\d+)\s*([KMGTPE]?)B?", text, re.I)
    if not m:
        raise ValueError(value)
    return int(m.group(1)) * _SIZE[m.group(2).upper()]


def unit_limits(unit_text: str) -> dict[str, str]:
    """MemoryMax=/MemoryHigh= as the unit's text sets them (the last assignment wins, as in systemd)."""
    found: dict[str, str] = {}
    for name, value in re.findall(rf"^({'|'.join(UNIT_SETTINGS)})=(.*)$", unit_text, re.M):
        found[name] = value.strip()
    return found


def show_limits(output: str) -> dict[str, str] | None:
    """`systemctl show -p LoadState,MemoryMax,MemoryHigh edge.service`'s output as settings;
    None when the unit is not loaded (not installed, or systemd does not know it)."""
    fields = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
    if fields.get("LoadState") != "loaded":
        return None
    return {k: v for k, v in fields.items() if k in UNIT_SETTINGS}


def _systemd_limits() -> dict[str, str] | None:
    systemctl = shutil.which("systemctl")
    if not systemctl or not SYSTEMD_RUNNING.is_dir():
        return None
    try:
        r = subprocess.run([systemctl, "show", "-p", "LoadState,MemoryMax,MemoryHigh", "edge.service"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return show_limits(r.stdout) if r.returncode == 0 else None


def _unit_bounds(unit_text: str | None, total: int) -> list[Bound]:
    settings, origin = _systemd_limits(), "systemctl show edge.service"
    if settings is None and unit_text is not None:
        settings, origin = unit_limits(unit_text), "the installed edge.service"
    bounds = []
    for name, value in (settings or {}).items():
        try:
            limit = unit_bytes(value, total)
        except ValueError:
            continue  # systemd itself refuses such a unit; the units check is the place for it
        if limit is not None:
            bounds.append(Bound(limit, f"{name}={value} of edge.service (from {origin})",
                                f"raise {name}= of edge.service above the need or remove it: "
                                f"`systemctl edit edge.service` ([Service] {name}=...), then "
                                "`systemctl restart edge.service`"))
    return bounds


def _reading_bound(reading: MemoryReading) -> Bound:
    cg = reading.bound_by
    if cg is None:
        return Bound(reading.available, "MemAvailable", "use a smaller quantization or free memory")
    return Bound(reading.available, f"the room under {cg.describe()}, the cgroup this doctor runs in (a "
                 "container's or slice's limit holds the service too)",
                 f"raise the memory limit of cgroup {cg.cgroup} (the container's, or the slice's "
                 "MemoryMax=/MemoryHigh=)")


def service_ceiling(unit_text: str | None = None) -> int | None:
    """The most edge.service may ever hold: MemTotal, the limit of the cgroup this doctor runs in,
    and the unit's MemoryMax=/MemoryHigh=, whichever is least (what an unset n_ctx is sized to:
    edge.model.memory.context_plan); None where nothing can be read."""
    try:
        reading = read_memory()
    except OSError:
        return None
    if not reading.total:
        return None
    return min([reading.ceiling, *(b.room for b in _unit_bounds(unit_text, reading.total))])


def memory_check(need: int, unit_text: str | None) -> Check:
    """`need`: the models' bytes (plus KV cache, which is not counted here)."""
    try:
        reading: MemoryReading | None = read_memory()
    except OSError:
        reading = None
    if reading is None or not reading.total:
        return ("memory", "warn", "cannot read MemAvailable from /proc/meminfo", "")
    bound = min([_reading_bound(reading), *_unit_bounds(unit_text, reading.total)], key=lambda b: b.room)
    msg = f"{mib(bound.room)} available to a start (bounded by {bound.what}), models need {mib(need)} plus KV cache"
    if bound.room < need:
        return ("memory", "fail", msg, bound.fix)
    if bound.room < need * 1.25:
        return ("memory", "warn", msg, "little headroom: lower n_ctx or stop other services"
                if bound.what == "MemAvailable" else bound.fix)
    return ("memory", "ok", msg, "")
