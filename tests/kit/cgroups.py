"""Trees of cgroup files for the memory reading's test double ($EDGE_TEST_CGROUP_ROOT,
edge.device.cgroup): /proc/self/cgroup and the files under /sys/fs/cgroup, laid out as the
kernel lays them out for cgroup v2, v1, or a hybrid host (v1's memory controller beside an
empty v2 hierarchy at /sys/fs/cgroup/unified)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["MIB", "cgroup_tree"]

MIB = 1 << 20


def cgroup_tree(root: Path, path: str, levels: dict[str, dict[str, int | str]], *,
                version: int = 2, hybrid: bool = False) -> Path:
    """Write the tree: the process is in cgroup `path`; `levels` maps each cgroup (its own path or
    an ancestor's, "/" for the hierarchy's root) to its files, e.g. {"memory.max": 64 * MIB,
    "memory.current": ..., "memory.stat": "inactive_file 123\\n"}. Returns `root`."""
    proc = root / "proc" / "self"
    proc.mkdir(parents=True, exist_ok=True)
    if version == 2:
        lines = ["0::" + path]
        mount = root / "sys" / "fs" / "cgroup"
        mount.mkdir(parents=True, exist_ok=True)
        (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    else:
        lines = ["12:pids:/", "4:memory:" + path, "1:name=systemd:" + path] + (["0::/"] if hybrid else [])
        mount = root / "sys" / "fs" / "cgroup" / "memory"
        if hybrid:
            (root / "sys" / "fs" / "cgroup" / "unified").mkdir(parents=True, exist_ok=True)
    (proc / "cgroup").write_text("\n".join(lines) + "\n")
    for level, files in levels.items():
        folder = mount / level.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        for name, value in files.items():
            (folder / name).write_text(f"{value}\n")
    return root
