"""Another local user can read no file edge wrote: a real `edge serve` run from a shell (umask
022, state and cache folders made 0755 beforehand, as a user's own folders may be) through a
start that crashes and one that crashes after READY (their journals, their crash records), a start that
restores a declared prefix, calibrates its warm-up after READY (the plan holds the workload's
prompts), learns prefixes from traffic, reloads and saves them at SIGTERM. Then every file under
those folders is tried as another user (uid 65534, with setpriv, as tests/lifecycle/test_priority.py
runs its probe): none can be opened. The modes are checked too: files 0600, folders 0700."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit import EDGE, PidOne, post, write_config
from kit.prom import until
from kit.unit import Unit

OTHER_UID = 65534  # nobody
SECRET = "CONFIDENTIAL the launch codes are in cabinet seven"  # a workload prompt, and a prefix
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="reads the files as another user: needs root and setpriv (util-linux)")
# after READY: calibrate at once; thresholds far above a tiny model's request times
WARMUP = ("min_gain_s = 0.5\nmin_gain_ratio = 1.0\nbudget_s = 120.0\nafter_ready_idle_s = 0.0\n"
          f'prompts = ["{SECRET}"]\n')
MODEL = f'n_threads = 1\nlearn_prefixes = 2\n[[models.prefixes]]\nname = "sys"\ntext = "{SECRET}. "\n'
_PROBE = """
import sys
opened = []
for path in sys.stdin.read().splitlines():
    try:
        with open(path, "rb") as f:
            f.read(1)
        opened.append(path)
    except OSError:
        pass
print("\\n".join(opened))
"""


@pytest.fixture()
def shared_base() -> Iterator[Path]:
    """A folder under /tmp that every user may enter (as a home folder often is), unlike pytest's
    own tmp folders (0700: nothing in them could be read by another user whatever its mode)."""
    base = Path(tempfile.mkdtemp(prefix="edge-private-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def _as_other_user(paths: list[Path]) -> list[str]:
    """The paths of `paths` another user (uid 65534) can open for reading."""
    r = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                        sys.executable, "-c", _PROBE], input="\n".join(map(str, paths)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line]


def _run_the_service(unit: Unit, plan: Path, base: Path) -> list[Path]:
    """The service's life as the module's docstring tells it; the journals the crash left
    (ExecStopPost='s `edge record-stop` settles each into a crash record and removes it)."""
    unit.pid1.env["EDGE_TEST_FAULT"] = "warmup:SEGV"  # a crash before READY: a failed-start record
    assert unit.start_once() is False and unit.exits[-1].returncode == -signal.SIGSEGV
    unit.pid1.env["EDGE_TEST_FAULT"] = "serving:SEGV"  # and one after READY: a crash record
    assert unit.start_once() is True
    assert unit.pid1.proc.wait(60) == -signal.SIGSEGV
    journals = [p for p in base.glob("state/journal/*") if p.is_file()]  # before ExecStopPost= settles them
    assert journals and _as_other_user(journals) == []
    assert any(b'{"ready":' in p.read_bytes() for p in journals)  # how far the crashed process got
    assert {stat.S_IMODE(p.stat().st_mode) for p in journals} == {0o600}
    unit.stop_post(-signal.SIGSEGV)
    del unit.pid1.env["EDGE_TEST_FAULT"]
    assert unit.start_until_ready(1)
    until("the calibration after READY stored its plan", lambda: plan.exists() or None, 120)
    common = "the world the " * 10
    for tail in ("a", "e", "o"):  # a prefix that traffic reuses: learned, saved at SIGTERM
        status, body = post(unit.pid1.address, "/v1/completions", {"prompt": common + tail, "max_tokens": 2})
        assert status == 200, body
    after = time.monotonic()
    unit.pid1.proc.send_signal(signal.SIGHUP)  # a reload: its report
    unit.pid1.wait_count("READY", 1, after=after, timeout=120)
    assert unit.stop().returncode == 0
    assert "learned prefixes saved for the next start: 1" in unit.pid1.log_tail(1 << 20)
    return journals


@needs_root
def test_another_local_user_can_read_no_file_edge_wrote(shared_base: Path, tiny_gguf: Path) -> None:
    for name in ("state", "cache"):
        (shared_base / name).mkdir()
        (shared_base / name).chmod(0o755)
    config = write_config(shared_base / "edge.toml", tiny_gguf, n_ctx=512, extra_model=MODEL, extra=WARMUP)
    plan = shared_base / "cache" / "warmup" / "model-tiny.json"
    env = {**os.environ, "EDGE_HOME": str(shared_base / "home")}  # the default state dir (recovery's pointers)
    umask = os.umask(0o022)  # a shell's: the spawned service inherits it
    try:
        with PidOne([*EDGE, "serve", "--config", str(config)], env=env) as pid1:
            journals = _run_the_service(Unit(pid1, config), plan, shared_base)
    finally:
        os.umask(umask)
    written = [p for p in shared_base.rglob("*") if p != config]
    files = [p for p in written if p.is_file()]
    names = {str(p.relative_to(shared_base)) for p in files}
    for expected in ("state/last-start.json", "state/last-reload.json", "cache/warmup/model-tiny.json",
                     "home/state/config-state-dirs.json"):
        assert expected in names, sorted(names)
    for pattern in ("state/reports/failed-start-*.json", "state/reports/crash-*.json", "state/reports/start-*.json",
                    "state/reports/reload-*.json", "cache/prefix/tiny/learned.*.kvstate", "cache/prefix/tiny/sys.*"):
        assert list(shared_base.glob(pattern)), pattern + ": " + "\n".join(sorted(names))
    assert journals and not [p for p in journals if p.exists()]  # settled into the records, removed
    modes = {str(p.relative_to(shared_base)): stat.S_IMODE(p.stat().st_mode) for p in written}
    roots = {"state", "cache"}  # made 0755 by this test, before edge
    assert {n: oct(m) for n, m in modes.items() if n not in roots and m != (0o700 if (shared_base / n).is_dir()
                                                                              else 0o600)} == {}
    assert _as_other_user(files) == []
    assert _as_other_user([shared_base / "edge.toml"]) == [str(shared_base / "edge.toml")]  # the probe can read
