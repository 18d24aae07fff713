"""Real Prometheus processes for the fleet tests: a server started on port 0 (its port read back
from /proc, so no port is guessed), PromQL queries against it, and promtool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = ["Prometheus", "listening_port", "need", "one", "samples", "until"]

T = TypeVar("T")


def need(binary: str) -> str:
    """The binary's path, or a skip that says why and where it comes from."""
    path = shutil.which(binary)
    if path is None:
        reason = (f"{binary} not found: it comes with the Debian package `prometheus`, which "
                  "scripts/setup installs (scripts/setup.d/prometheus.sh)")
        print(reason)
        pytest.skip(reason)
    return path


def until(what: str, check: Callable[[], T | None], timeout: float, proc: subprocess.Popen | None = None,
          log: Path | None = None) -> T:
    """Poll `check` until it returns something (a condition, not a sleep-based guess)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}: "
                                 f"{log.read_text()[-2000:] if log else ''}")
        value = check()
        if value is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s" + (f"; log: {log.read_text()[-2000:]}" if log else ""))


def listening_port(pid: int) -> int | None:
    """A TCP port the process listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                return int(f[1].rsplit(":", 1)[1], 16)
    return None


class Prometheus:
    """`prometheus` with the given flags, on 127.0.0.1 port 0, its data and log in `folder`."""

    def __init__(self, folder: Path, config: str, *flags: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "prometheus.yml").write_text(config)
        self.log = folder / "prometheus.log"
        storage = "--storage.agent.path" if "--enable-feature=agent" in flags or "--agent" in flags \
            else "--storage.tsdb.path"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [need("prometheus"), f"--config.file={folder / 'prometheus.yml'}", f"{storage}={folder / 'data'}",
                 "--web.listen-address=127.0.0.1:0", *flags], stdout=out, stderr=subprocess.STDOUT)
        self.port = until("prometheus listening", lambda: listening_port(self.proc.pid), 60, self.proc, self.log)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def samples(text: str) -> dict[str, list[Any]]:
    """An exposition parsed by prometheus_client: sample name -> its samples (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(found: dict[str, list[Any]], name: str, **labels: str) -> Any:
    """The one sample of `name` whose labels include `labels`."""
    hits = [s for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples: {found.get(name)}"
    return hits[0]
