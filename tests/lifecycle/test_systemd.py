"""sd_notify, socket handover and the watchdog, against a real NOTIFY_SOCKET receiver."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from edge.lifecycle.systemd import Notifier, watchdog_interval_s


@pytest.fixture()
def receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def test_notifier_sends_ready_status_and_stopping(receiver: socket.socket) -> None:
    n = Notifier()
    assert n.status("loading")
    assert receiver.recv(4096) == b"STATUS=loading"
    assert n.ready("ready: x")
    msg = receiver.recv(4096).decode()
    assert "READY=1" in msg and "STATUS=ready: x" in msg and f"MAINPID={os.getpid()}" in msg
    assert n.stopping()
    assert receiver.recv(4096).startswith(b"STOPPING=1")


def test_extend_timeout_repeats_until_stopped(receiver: socket.socket) -> None:
    n = Notifier()
    n.extend_while(period_s=0.05)
    msgs = [receiver.recv(4096) for _ in range(3)]
    assert all(m == b"EXTEND_TIMEOUT_USEC=150000" for m in msgs)
    n.stop_extending()  # returns once the extender thread has ended: nothing is sent after it
    assert not [t for t in threading.enumerate() if t.name == "edge-extend-timeout"]
    receiver.setblocking(False)
    drained = []
    try:
        while True:
            drained.append(receiver.recv(4096))
    except BlockingIOError:
        pass
    assert len(drained) <= 1  # at most the one sent while it was being stopped


def test_without_notify_socket_everything_is_a_quiet_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert Notifier().ready("x") is False


def test_watchdog_interval_respects_watchdog_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval_s() is None


def test_listen_fds_are_taken_only_by_the_named_pid(tmp_path: Path) -> None:
    lst = socket.create_server(("127.0.0.1", 0))
    probe = ("from edge.lifecycle.systemd import listen_sockets; s = listen_sockets(); "
             "print(len(s), s[0].getsockname()[1] if s else '', s[0].type if s else '')")
    script = 'export LISTEN_PID=${PID_OVERRIDE:-$$}; exec "$@"'
    for override, expect in (("", f"1 {lst.getsockname()[1]} {int(socket.SOCK_STREAM)}"), ("1", "0  ")):
        out = tmp_path / f"out{override}"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT)
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", script, "sh", sys.executable, "-c", probe],
                             {**os.environ, "LISTEN_FDS": "1", "PID_OVERRIDE": override},
                             file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1),
                                           (os.POSIX_SPAWN_DUP2, lst.fileno(), 3)])
        os.close(fd)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert out.read_text().rstrip("\n") == expect
    lst.close()


def test_watchdog_pings_at_least_every_half_interval(tiny_config: Path, service) -> None:
    pid1 = service(tiny_config, watchdog_usec=1_000_000)
    ready = pid1.wait_for("READY", "1")
    pings = [n.at for n in pid1.wait_count("WATCHDOG", 7, after=ready.at, timeout=10)]  # serving, idle
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) <= 0.5, gaps
    assert pings[-1] - pings[0] >= 6 * 0.2  # paced by the interval (1 s / 4), not a busy loop
    assert pid1.stop() == 0
