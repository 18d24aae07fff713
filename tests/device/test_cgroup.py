"""The memory a start may really use: MemAvailable bounded by the cgroup's limit (v2 and v1, the
ancestors', the working set), read from fixture trees ($EDGE_TEST_CGROUP_ROOT, the test double
of the memory reading) and, for consistency only, from this machine's own cgroup."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.device.cgroup import TEST_CGROUP_ROOT_ENV, UNLIMITED_V1, memory_limit
from edge.device.memory import TEST_MEMINFO_ENV, read_memory
from kit.cgroups import MIB, cgroup_tree

SERVICE = "/system.slice/edge.service"


def meminfo(tmp_path: Path, available_mib: int, total_mib: int = 8192) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: {total_mib * 1024} kB\nMemFree: 1024 kB\nMemAvailable: {available_mib * 1024} kB\n")
    return p


def test_v2_the_services_memory_max_less_its_working_set(tmp_path: Path) -> None:
    root = cgroup_tree(tmp_path / "t", SERVICE, {
        SERVICE: {"memory.max": 512 * MIB, "memory.high": "max", "memory.current": 300 * MIB,
                  "memory.stat": f"anon {200 * MIB}\nfile {100 * MIB}\nactive_file {40 * MIB}\n"
                                 f"inactive_file {60 * MIB}\n"},
        "/system.slice": {"memory.max": "max", "memory.high": "max", "memory.current": 900 * MIB},
    })
    limit = memory_limit(root=root)
    assert limit is not None
    assert (limit.cgroup, limit.setting, limit.limit, limit.used, limit.version) == \
        (SERVICE, "memory.max", 512 * MIB, 240 * MIB, 2)  # inactive page cache is not counted
    assert limit.room == 272 * MIB
    assert "memory.max of cgroup /system.slice/edge.service (v2): 512 MiB, 240 MiB in use" == limit.describe()


def test_v2_memory_high_and_an_ancestors_limit_bind_when_they_leave_less_room(tmp_path: Path) -> None:
    root = cgroup_tree(tmp_path / "high", SERVICE, {
        SERVICE: {"memory.max": 2048 * MIB, "memory.high": 1024 * MIB, "memory.current": 100 * MIB}})
    assert memory_limit(root=root).setting == "memory.high"
    # a slice's MemoryMax= holds every service in it: its usage counts the siblings too
    root = cgroup_tree(tmp_path / "slice", SERVICE, {
        SERVICE: {"memory.max": 2048 * MIB, "memory.current": 100 * MIB},
        "/system.slice": {"memory.max": 1536 * MIB, "memory.current": 1400 * MIB}})
    limit = memory_limit(root=root)
    assert (limit.cgroup, limit.room) == ("/system.slice", 136 * MIB)
    # no limit anywhere ("max" or no file): nothing bounds the reading
    root = cgroup_tree(tmp_path / "none", SERVICE, {SERVICE: {"memory.max": "max", "memory.current": 5}})
    assert memory_limit(root=root) is None


def test_v2_inside_a_container_the_namespace_root_holds_the_limit(tmp_path: Path) -> None:
    # A container with a cgroup namespace sees itself at "/", its limit in /sys/fs/cgroup/memory.max.
    root = cgroup_tree(tmp_path / "ns", "/", {"/": {"memory.max": 768 * MIB, "memory.current": 68 * MIB}})
    limit = memory_limit(root=root)
    assert (limit.cgroup, limit.limit, limit.room) == ("/", 768 * MIB, 700 * MIB)


def test_v1_and_a_hybrid_host_read_the_memory_controller(tmp_path: Path) -> None:
    path = "/docker/abc123"
    levels = {path: {"memory.limit_in_bytes": 1024 * MIB, "memory.usage_in_bytes": 600 * MIB,
                     "memory.stat": f"inactive_file {10 * MIB}\ntotal_inactive_file {100 * MIB}\n"},
              "/docker": {"memory.limit_in_bytes": UNLIMITED_V1 + 4096, "memory.usage_in_bytes": 900 * MIB},
              "/": {"memory.limit_in_bytes": UNLIMITED_V1 + 4096}}
    for hybrid in (False, True):
        root = cgroup_tree(tmp_path / f"v1-{hybrid}", path, levels, version=1, hybrid=hybrid)
        limit = memory_limit(root=root)
        assert (limit.cgroup, limit.setting, limit.used, limit.room, limit.version) == \
            (path, "memory.limit_in_bytes", 500 * MIB, 524 * MIB, 1)  # total_inactive_file: hierarchical


def test_no_cgroup_file_is_no_limit(tmp_path: Path) -> None:
    assert memory_limit(root=tmp_path) is None  # no /proc/self/cgroup: another OS layout
    cgroup_tree(tmp_path / "empty", SERVICE, {})
    assert memory_limit(root=tmp_path / "empty") is None


def test_read_memory_takes_the_smaller_and_says_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = cgroup_tree(tmp_path / "t", SERVICE, {SERVICE: {"memory.max": 512 * MIB, "memory.current": 12 * MIB}})
    monkeypatch.setenv(TEST_MEMINFO_ENV, str(meminfo(tmp_path, available_mib=4096)))
    monkeypatch.setenv(TEST_CGROUP_ROOT_ENV, str(root))
    r = read_memory()
    assert (r.available, r.source, r.ceiling) == (500 * MIB, f"cgroup {SERVICE} memory.max", 512 * MIB)
    assert r.as_dict()["cgroup"]["room_mib"] == 500
    monkeypatch.setenv(TEST_MEMINFO_ENV, str(meminfo(tmp_path, available_mib=300)))
    r = read_memory()
    assert (r.available, r.source) == (300 * MIB, f"{tmp_path / 'meminfo'} MemAvailable")
    assert r.cgroup is not None and r.ceiling == 512 * MIB  # known, just not the tighter bound
    # the meminfo double alone replaces the whole reading: no cgroup of the machine the test runs on
    monkeypatch.delenv(TEST_CGROUP_ROOT_ENV)
    r = read_memory()
    assert r.cgroup is None and r.ceiling == 8192 * MIB


def _own_cgroup() -> tuple[int, str, Path]:
    """(version, path, mount) of this process's memory controller, read the plain way."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if "memory" in line.split(":")[1].split(",")]
    if v1:
        return 1, v1[0], Path("/sys/fs/cgroup/memory")
    base = Path("/sys/fs/cgroup")
    path = next(line[3:] for line in lines if line.startswith("0::"))
    return 2, path, base if (base / "cgroup.controllers").exists() else base / "unified"


def test_this_machines_own_cgroup_is_read_consistently(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TEST_MEMINFO_ENV, raising=False)
    monkeypatch.delenv(TEST_CGROUP_ROOT_ENV, raising=False)
    r = read_memory()
    assert r.total > 0 and r.available >= 0
    version, path, mount = _own_cgroup()
    limit = r.cgroup
    if limit is None:  # then no level of this cgroup has a limit in its files
        assert r.source == "/proc/meminfo MemAvailable"
        names = ("memory.max", "memory.high") if version == 2 else ("memory.limit_in_bytes",)
        levels = [path, *(str(a) for a in Path(path).parents)]
        values = [(mount / lv.lstrip("/") / n).read_text().strip() for lv in levels for n in names
                  if (mount / lv.lstrip("/") / n).is_file()]
        assert all(v == "max" or int(v) >= UNLIMITED_V1 for v in values), values
        return
    # the limit found is this process's cgroup's or an ancestor's, and its file says so
    assert limit.version == version
    assert path == limit.cgroup or path.startswith(limit.cgroup.rstrip("/") + "/")
    assert int((mount / limit.cgroup.lstrip("/") / limit.setting).read_text()) == limit.limit
    assert limit.room >= 0
    if r.source.startswith("cgroup "):
        assert r.available == limit.room and r.source == f"cgroup {limit.cgroup} {limit.setting}"
    else:
        assert r.available <= limit.room
