"""`edge stop`, the unit's ExecStop=: SIGTERM to the main process, then wait until it is gone —
what systemd does not do for a main process that is not its own child (after a handover)."""

from __future__ import annotations

import os
import subprocess
import sys

from kit import EDGE

DRAINS = """
import signal, sys
def term(*_):
    print("term", flush=True)
    sys.stdin.readline()  # drains until the test lets it go
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("up", flush=True)
signal.pause()
"""


def test_stop_waits_for_the_process_to_drain_and_end() -> None:
    child = subprocess.Popen([sys.executable, "-c", DRAINS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None and child.stdout.readline() == "up\n"
    stop = subprocess.Popen([*EDGE, "stop"], env={**os.environ, "MAINPID": str(child.pid)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "term\n"  # it got the SIGTERM and is draining
        assert stop.poll() is None  # ... and `edge stop` waits for it
        child.stdin.write("done\n")
        child.stdin.flush()
        out, err = stop.communicate(timeout=60)
        assert stop.returncode == 0 and child.wait(timeout=60) == 0, err
    finally:
        child.kill()
        stop.kill()


def test_stop_with_a_bound_says_when_the_process_outlives_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", DRAINS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        r = subprocess.run([*EDGE, "stop", "--pid", str(child.pid), "--timeout", "0.5"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and f"pid {child.pid} still runs" in r.stderr and "Traceback" not in r.stderr
    finally:
        child.kill()
        child.wait()


def test_stop_without_a_process_names_mainpid() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MAINPID"}
    r = subprocess.run([*EDGE, "stop"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "$MAINPID" in r.stderr and "Traceback" not in r.stderr


def test_stop_after_the_main_process_ended_by_itself_is_a_clean_stop() -> None:
    """systemd runs ExecStop= also after the main process exited on its own (a give-up that ended:
    docs/faults.md "Native faults"), with no $MAINPID and $SERVICE_RESULT set: exit 0, or the unit's clean
    exit would be `Failed with result 'exit-code'` and restarted."""
    env = {k: v for k, v in os.environ.items() if k != "MAINPID"}
    r = subprocess.run([*EDGE, "stop"], capture_output=True, text=True, timeout=60,
                       env={**env, "SERVICE_RESULT": "success", "EXIT_CODE": "exited", "EXIT_STATUS": "0"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
