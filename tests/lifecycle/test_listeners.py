"""No door without a key: a real, socket-activated `edge serve` listens on the socket it was given
and on its control socket, and on nothing else, whatever it is doing. Its listening sockets are
read from the kernel (tests/kit/procsockets.py: /proc/PID/fd joined with /proc/PID/net/tcp,
tcp6 and unix), not from edge's own bookkeeping, by a sampler that runs from the exec on:
through the start's warm-up, at READY, during the calibration after READY, across three reloads
that load and warm a new set, and through a SIGTERM that comes during a calibration.

The control socket (edge.lifecycle.control) is the one designed listener besides the served
socket: a Unix socket in the state directory, mode 0600, that takes `edge reload`'s requests
and serves no route. The warm-up's requests cross uvicorn's HTTP protocol over a socket pair
(edge.lifecycle.warmup.steps.LoopbackHTTP), which is no listener: nothing another local
process could connect to."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit import PidOne, call, write_config
from kit.procsockets import Listener, listening, socket_inodes
from kit.prom import until

# one llama.cpp thread; calibration keeps nothing on a tiny model (thresholds far above its times),
# and the workload prompts make a few more candidates for it to measure after READY
TINY = "n_batch = 64\nn_threads = 1"
WARMUP = ("min_gain_s = 0.5\nmin_gain_ratio = 1.0\nbudget_s = 120.0\nafter_ready_idle_s = 0.0\n"
          'prompts = ["The field unit reported nominal telemetry", "Battery voltage held at 12.6 volts"]\n')


def plan_file(config: Path) -> Path:
    return config.parent / "cache" / "warmup" / "model-tiny.json"


@dataclass
class Sampler:
    """The process's listening sockets, read again and again on a thread until stopped; each
    reading with whether READY had been sent and whether the warm-up plan was stored yet."""

    pid1: PidOne
    plan: Path
    readings: list[tuple[float, frozenset[Listener], bool, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        pid = self.pid1.proc.pid
        while not self.stop.is_set() and self.pid1.proc.poll() is None:
            ready = any(n.fields.get("READY") == "1" for n in self.pid1.notifications)
            planned = self.plan.exists()
            try:
                found = frozenset(listening(pid))
            except (FileNotFoundError, ProcessLookupError):
                return  # the process is gone
            self.readings.append((time.monotonic(), found, ready, planned))
            self.stop.wait(0.002)  # the sampling period, not a wait for anything

    def __enter__(self) -> "Sampler":
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def allowed(pid1: PidOne, state: Path) -> set[tuple[str, str | int]]:
    """What may listen: the socket PidOne passed as fd 3 (by inode), and the control socket (by path)."""
    return {("inode", os.fstat(pid1.listener.fileno()).st_ino), ("unix", str(state / "control.sock"))}


def named(listeners: frozenset[Listener] | set[Listener], served: int) -> set[tuple[str, str | int]]:
    return {("inode", x.inode) if x.inode == served else ("unix", x.address) if x.family == "unix"
            else (x.family, x.address) for x in listeners}


def _health(conn: socket.socket, rest: bytes = b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n") -> bytes:
    """Send (the rest of) a request for /healthz on `conn` and read its whole answer (head and
    Content-Length bytes), leaving the connection open."""
    conn.sendall(rest)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += conn.recv(4096)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(4096)
    return raw


def _sockets_open(pid1: PidOne) -> int:
    return len(socket_inodes(pid1.proc.pid))


def test_only_the_served_sockets_listen_from_the_start_through_reloads(tmp_path: Path, tiny_gguf: Path,
                                                                        service) -> None:
    config = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY, extra=WARMUP)
    state = tmp_path / "state"
    pid1 = service(config, ready=False)
    served = os.fstat(pid1.listener.fileno()).st_ino
    expected = allowed(pid1, state)
    with Sampler(pid1, plan_file(config)) as sampler:
        pid1.wait_for("READY", "1", timeout=120)
        at_ready = named(listening(pid1.proc.pid), served)
        assert at_ready == expected, at_ready
        until("the calibration after READY stored its plan", lambda: plan_file(config).exists() or None, 120)
        idle_sockets = _sockets_open(pid1)
        # three reloads, each loading the model anew (another n_ctx) and warming it before the switch
        for i, n_ctx in enumerate((512, 256, 512)):
            config.write_text(config.read_text().replace(f"n_ctx = {256 if n_ctx == 512 else 512}", f"n_ctx = {n_ctx}"))
            after = time.monotonic()
            pid1.proc.send_signal(signal.SIGHUP)
            (ready,) = pid1.wait_count("READY", 1, after=after, timeout=120)
            assert ready.fields["STATUS"].startswith("ready: serving tiny"), ready.fields
        after_reloads = named(listening(pid1.proc.pid), served)
    assert after_reloads == expected, after_reloads
    # no socket pair of the warm-ups is left open either (a client's connection closes meanwhile)
    until("as many sockets as after the start's calibration", lambda: _sockets_open(pid1) <= idle_sockets or None, 30)
    seen = [(t, named(found, served), ready, planned) for t, found, ready, planned in sampler.readings]
    stray = [(round(t, 3), s - expected) for t, s, _, _ in seen if not s <= expected]
    assert not stray, stray[:5]  # before READY (the warm-up), after it, during the reloads' warm-ups
    calibrating = [s for _, s, ready, planned in seen if ready and not planned]
    before_ready = [s for _, s, ready, _ in seen if not ready]
    assert len(calibrating) >= 3 and len(before_ready) >= 3, (len(calibrating), len(before_ready))
    # a route on any other local port: there is none; the served one needs nothing more than it did
    assert [x for x in listening(pid1.proc.pid) if x.family != "unix" and x.inode != served] == []
    assert call(pid1.address, "GET", "/v1/models")[0] == 200
    assert pid1.stop() == 0


def test_a_sigterm_during_the_calibration_after_ready_leaves_no_listener(tmp_path: Path, tiny_gguf: Path,
                                                                         service) -> None:
    """SIGTERM right at READY, while the calibration after READY runs: the drain (held open by a
    connection whose request head is half sent) listens on nothing new, the calibration is cut
    (its plan not stored whole), and the service exits 0 once that request is answered."""
    config = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=TINY, extra=WARMUP)
    pid1 = service(config, ready=False)
    served = os.fstat(pid1.listener.fileno()).st_ino
    expected = allowed(pid1, tmp_path / "state")
    with Sampler(pid1, plan_file(config)) as sampler:
        pid1.wait_for("READY", "1", timeout=120)
        slow = socket.create_connection(pid1.address, timeout=60)
        assert _health(slow).startswith(b"HTTP/1.1 200")  # accepted: a kept-alive connection now
        slow.sendall(b"GET /healthz HTTP/1.1\r\n")  # the drain waits for the rest of this head
        pid1.proc.send_signal(signal.SIGTERM)
        pid1.wait_for("STOPPING", "1", timeout=60)
        during_drain = named(listening(pid1.proc.pid), served)
        answer = _health(slow, b"Host: edge\r\n\r\n")
        slow.close()
        assert pid1.proc.wait(timeout=60) == 0, pid1.log_tail()
    assert during_drain <= expected, during_drain
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower(), answer[:200]
    stray = [(round(t, 3), named(found, served) - expected) for t, found, _, _ in sampler.readings
             if not named(found, served) <= expected]
    assert not stray, stray[:5]
    stored = plan_file(config).read_text() if plan_file(config).exists() else None
    assert stored is None or '"pending": true' in stored, "the SIGTERM came after the calibration ended"
