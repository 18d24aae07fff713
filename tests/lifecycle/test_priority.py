"""A handover's new process gives up CPU priority only where it can take it back: measured as an
unprivileged user (what DynamicUser= gives the service), with RLIMIT_NICE as the unit's
LimitNICE=+0 sets it (20) and as a shell's default (0)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

_PROBE = """\
import json, os, threading
from edge.lifecycle.handover.priority import yield_cpu
y = yield_cpu()
seen = {"yielded": y is not None, "main": os.getpriority(os.PRIO_PROCESS, 0)}
started, restored = threading.Event(), threading.Event()
def worker():  # started after the yield, as the journal, page-in and llama.cpp threads are
    seen["thread"] = os.getpriority(os.PRIO_PROCESS, 0)
    started.set()
    restored.wait(30)
    seen["thread_after"] = os.getpriority(os.PRIO_PROCESS, 0)
t = threading.Thread(target=worker)
t.start()
started.wait(30)
seen["failed"] = y.restore() if y else None
seen["main_after"] = os.getpriority(os.PRIO_PROCESS, 0)
restored.set()
t.join()
print(json.dumps(seen))
"""


def _probe(rlimit_nice: int, caps: str = "-all", lowered_by_parent: bool = False) -> dict:
    """The probe run as `nobody` with RLIMIT_NICE set to `rlimit_nice` and the ambient capabilities
    `caps` (setpriv's syntax: -all is none, as under DynamicUser= with CapabilityBoundingSet=)."""
    ambient = [] if caps == "-all" else [f"--ambient-caps={caps}"]
    # lowered_by_parent: started at nice 10 with the service's 0 named, as a handover's old process
    # spawns its new one (edge.lifecycle.handover.priority.lower_child)
    nice = ["nice", "-n", "10"] if lowered_by_parent else []
    argv = ["prlimit", f"--nice={rlimit_nice}:{rlimit_nice}", "--", *nice, "setpriv", "--reuid=65534",
            "--regid=65534", "--clear-groups", f"--inh-caps={caps}", *ambient, sys.executable, "-c", _PROBE]
    base = {"EDGE_HANDOVER_BASE_NICE": "0"} if lowered_by_parent else {}
    # at nice 0 as systemd starts a unit, whatever the niceness the tests run at (root may raise it)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0),
                       env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1", **base})
    if "failed to set the NICE resource limit" in r.stderr:
        pytest.skip("this machine cannot raise RLIMIT_NICE (no CAP_SYS_RESOURCE here)")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"),
                                reason="runs the probe as another user: needs root, setpriv and prlimit")


def _yielded_and_restored(seen: dict) -> None:
    assert seen["yielded"] and seen["main"] == 10 and seen["thread"] == 10  # a later thread inherits it
    assert seen["failed"] == [] and seen["main_after"] == 0 and seen["thread_after"] == 0


@needs_root
def test_with_limitnice_0_it_yields_and_every_thread_takes_its_priority_back() -> None:
    _yielded_and_restored(_probe(20))  # LimitNICE=+0: nice 0 may be taken back, nothing above it


@needs_root
def test_started_lowered_by_the_old_process_it_takes_the_named_priority_back() -> None:
    _yielded_and_restored(_probe(0, "+sys_nice", lowered_by_parent=True))  # not lowered twice (19): back to 0


@needs_root
def test_with_cap_sys_nice_it_yields_and_takes_it_back() -> None:
    _yielded_and_restored(_probe(0, "+sys_nice"))


@needs_root
def test_without_the_limit_it_does_not_yield_at_all() -> None:
    seen = _probe(0)  # the default: a niced process could never be un-niced
    assert not seen["yielded"] and seen["main"] == 0 and seen["thread"] == 0 and seen["main_after"] == 0
