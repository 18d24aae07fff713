"""The harness notices a death at once: kit.PidOne and scripts/demo report a service that exits
(a bad config: 78) or is killed by a signal while a client waits, within a second, with its exit
status or signal and the tail of its log; a service the kit started dies with the test process."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edge.serve.client import encode_request
from kit import EDGE, PidOne, ServiceExited, describe_status, post, write_config

TESTS = Path(__file__).resolve().parents[1]
DEMO = TESTS.parent / "scripts" / "demo.py"
QUESTION = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


def test_a_service_that_exits_at_once_is_reported_with_its_status_and_log(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra="no_such_key = 1")  # 78, ConfigError
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        child = pid1.start()
        with pytest.raises(ServiceExited) as info:
            pid1.wait_for("READY", "1", timeout=300)
        noticed = time.monotonic() - child.exited_at
    assert noticed < 1.0, noticed
    exc = info.value
    assert exc.returncode == 78 and "exited with status 78 before READY=1" in str(exc)
    assert "no_such_key" in exc.log_tail and exc.log_tail in str(exc)


def test_a_service_killed_while_a_client_waits_is_reported_at_once(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        child = pid1.start()
        pid1.wait_for("STATUS", "importing the inference backends")  # early in the start, before READY

        def ask_and_fault() -> bytes:
            with socket.create_connection(pid1.address, timeout=300) as s:
                s.sendall(encode_request("POST", "/v1/completions", QUESTION))  # waits in the backlog
                child.send_signal(signal.SIGSEGV)  # a native fault (a real signal) while it waits
                return s.recv(65536)

        with pytest.raises(ServiceExited) as info:
            pid1.while_running(ask_and_fault, what="the answer")
        noticed = time.monotonic() - child.exited_at
        log = pid1.log_path.read_text()
    assert noticed < 1.0, noticed
    exc = info.value
    assert exc.returncode == -signal.SIGSEGV and "was killed by SIGSEGV before the answer" in str(exc)
    assert exc.log_tail and exc.log_tail in str(exc) and log.endswith(exc.log_tail)
    assert "importing the inference backends" in log and "Fatal Python error: Segmentation fault" in log


def test_describe_status() -> None:
    assert describe_status(0) == "exited with status 0" and describe_status(-9) == "was killed by SIGKILL"


def test_a_start_from_a_thread_that_ends_keeps_its_service(tmp_path: Path, tiny_gguf: Path) -> None:
    # PR_SET_PDEATHSIG fires when the spawning thread ends: PidOne spawns on its own long-lived thread
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        starter = threading.Thread(target=pid1.start)
        starter.start()
        starter.join()
        pid1.wait_for("READY", "1", timeout=300)
        assert post(pid1.address, "/v1/completions", QUESTION)[0] == 200
        assert pid1.stop() == 0


HARNESS = """
import sys
sys.path.insert(0, sys.argv[1])
from harness import PidOne
pid1 = PidOne(sys.argv[2:])
child = pid1.start()
pid1.wait_for("READY", "1", timeout=300)
print(child.pid, flush=True)
sys.stdin.read()  # until this process is killed
"""


def test_a_killed_test_process_leaves_no_service(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(TESTS.parent / "scripts"), *EDGE, "serve", "--config", str(cfg)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = harness.stdout.readline()
        assert line.strip().isdigit(), f"the harness did not start the service: {line!r}"
        service = int(line)
        pidfd = os.pidfd_open(service)  # readable once that process has exited, whoever reaps it
        harness.kill()  # SIGKILL: no close(), no atexit, no finally
        harness.wait(60)
        readable, _, _ = select.select([pidfd], [], [], 60)
        os.close(pidfd)
        assert readable, f"edge serve (pid {service}) outlived the SIGKILLed test process that started it"
    finally:
        harness.kill()
        harness.wait(60)


def _demo(home: Path) -> subprocess.Popen:
    env = {**os.environ, "EDGE_HOME": str(home)}
    return subprocess.Popen([sys.executable, str(DEMO)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_demo_reports_a_service_that_exits_at_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("a file where the state dir's parent should be")  # state dir not writable: 78
    demo = _demo(home)
    out, err = demo.communicate(timeout=300)
    assert demo.returncode == 1, (out, err)
    assert "exited with status 78 before the answer to the question" in err and "paths.state_dir" in err, err
    noticed = float(err.split("(noticed ")[1].split(" s")[0])
    assert noticed < 1.0, err


def test_the_demo_reports_a_service_killed_by_a_signal(tmp_path: Path) -> None:
    demo = _demo(tmp_path / "home")
    try:
        line = ""
        while "is pid" not in line:
            line = demo.stderr.readline()
            assert line, "the demo ended before it started the service"
        service = int(line.split("is pid ")[1].split(";")[0])
        os.kill(service, signal.SIGSEGV)  # while the question waits for its answer
        out, err = demo.communicate(timeout=300)
    finally:
        demo.kill()
        demo.wait(60)
    assert demo.returncode == 1, (out, err)
    assert f"the service (pid {service}) was killed by SIGSEGV before the answer to the question" in err, err
    assert "its log ends:" in err and float(err.split("(noticed ")[1].split(" s")[0]) < 1.0, err
