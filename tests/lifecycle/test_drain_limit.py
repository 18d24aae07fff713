"""The drain's limit ends every sequence cleanly (issue 57, issue 56 item 7), against a real
`edge serve` under the PID-1 stand-in: 8 clients (4 long generations that hold every slot, 4
short ones queued behind them; streamed and not), `drain_timeout_s = 5`, `request_timeout_s = 120`.

- SIGTERM: the process is gone within drain + 2 s; what still ran or waited at the limit is ended
  by edge: a non-streamed request gets a JSON 503 with Retry-After (its retry, as OpenAI's SDK
  makes it, is answered by the next start on the same socket), a stream its error event and
  `[DONE]`; no 5xx left, no connection left half-closed, the log says "ended by the server".
- a handover (`edge reload --process`): the queued requests are passed on at the switch, with
  their connections, and answered by the new process; at the limit a non-streamed request is
  passed on too (it starts again there) and a stream gets its error event and `[DONE]`: no 5xx
  at all, without a retry; the old process is gone within drain + 2 s of the switch.

The long generations are sized from this machine's speed (`_tokens_for`), so that they outlast the
limit whether the machine is quiet or loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness.answers import Answer, Clients, Loop, ask
from kit import EDGE, metric, write_config

DRAIN_S = 5.0
SERVER = f"drain_timeout_s = {DRAIN_S:g}\nrequest_timeout_s = 120"
MODEL = "parallel = 4\nn_threads = 1"  # 4 slots: the long generations hold them all
N_CTX = 16384
NO_EOS = {"2": -100}  # the tiny model's end-of-sequence token: every generation runs to max_tokens


def body(max_tokens: int, stream: bool, n: int = 0) -> dict:
    return {"prompt": f"Hello {n}", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "logit_bias": NO_EOS}


def config(tmp_path: Path, tiny_gguf: Path) -> Path:
    return write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=N_CTX, server=SERVER, extra_model=MODEL)


def _tokens_for(address: tuple[str, int], seconds: float, together: int = 4) -> int:
    """Tokens a generation beside `together` - 1 others takes `seconds` to make here (measured
    now, with that many of them), within what that many fit in the context."""
    t0 = time.monotonic()
    answers = Clients(address, [body(64, False, n) for n in range(together)]).start().wait(120)
    assert all(a.status == 200 for a in answers), [a.body[:200] for a in answers]
    per_token = (time.monotonic() - t0) / 64
    return max(200, min(N_CTX // together - 64, int(seconds / per_token)))


def _until(what: str, ok, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)  # bounded polling of a condition the service reports


def _load(address: tuple[str, int], long_tokens: int, retries: int) -> tuple[Clients, Clients]:
    """4 long generations holding every slot (2 streamed), then 4 short ones queued behind them."""
    longs = Clients(address, [body(long_tokens, i % 2 == 1, i) for i in range(4)], retries=retries,
                    timeout=300).start()
    _until("4 slots busy", lambda: metric(address, "edge_slots_busy", model="tiny") == 4)
    shorts = Clients(address, [body(16, i % 2 == 1, 10 + i) for i in range(4)], retries=retries,
                     timeout=300).start()
    _until("8 requests queued or running", lambda: metric(address, "edge_queue_depth", model="tiny") == 8)
    return longs, shorts


def _half_closed(port: int) -> list[str]:
    """TCP connections of this machine on `port` left in CLOSE-WAIT (one side closed, the other never)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "08" and port in (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)):
                rows.append(line.strip())
    return rows


def _no_half_closed(port: int) -> None:
    """A client that closed first leaves the server's end in CLOSE-WAIT until its loop reads the
    end (a moment); one left there is a connection the server never closes."""
    _until(f"no connection on port {port} in CLOSE-WAIT ({_half_closed(port)})", lambda: not _half_closed(port), 10)


def _old_log(text: str, pid: int) -> str:
    return "\n".join(line for line in text.splitlines() if f"edge[{pid}]" in line)


def _clean(log: str) -> None:
    """No traceback, no task cancelled by uvicorn, no request taken for a client's 499 (both processes)."""
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "timeout graceful shutdown exceeded" not in log and "status 499" not in log, log[-3000:]
    assert "ASGI callable returned without" not in log, log[-3000:]


def test_sigterm_ends_every_sequence_at_the_limit(tmp_path: Path, tiny_gguf: Path, service) -> None:
    pid1 = service(config(tmp_path, tiny_gguf))
    old = pid1.proc
    longs, shorts = _load(pid1.address, _tokens_for(pid1.address, 15.0), retries=2)
    sent = time.monotonic()
    old.send_signal(signal.SIGTERM)
    assert old.wait(30) == 0
    assert old.exited_at - sent <= DRAIN_S + 2.0, f"exited {old.exited_at - sent:.2f} s after SIGTERM"
    log = _old_log(pid1.log_tail(400_000), old.pid)
    (journal,) = (tmp_path / "state" / "journal").glob(f"{old.pid}-*.jsonl")  # read before the next start settles it
    end = json.loads(journal.read_text().splitlines()[-1])
    assert end["end"] == "ok" and end["exit"] == 0 and end["ended_at_limit"] == 8 and "cut_at_limit" not in end, end
    pid1.start()  # the next start on the same socket, as socket activation makes it: the retries wait for it
    pid1.wait_for("READY", "1")
    answers = longs.wait(300) + shorts.wait(300)
    for a in answers:
        assert a.status == 200 and a.whole, (a.statuses, a.error, a.body[-300:])
        if a.streamed:  # ended by the drain's limit: its error event, then [DONE]
            assert a.statuses == [200] and a.done, a.body[-300:]
            assert a.error_event["code"] == "server_shutting_down", a.error_event
        else:  # a 503 with Retry-After, retried: answered whole by the next process
            assert a.statuses == [503, 200], a.statuses
            assert a.json()["usage"]["completion_tokens"] == a.body_sent["max_tokens"]
    assert "drain: 8 requests still running after server.drain_timeout_s = 5 s" in log, log[-3000:]
    assert log.count("ended by the server: draining past server.drain_timeout_s") == 8, log[-3000:]
    _clean(pid1.log_tail(400_000))
    _no_half_closed(pid1.address[1])
    assert pid1.stop() == 0


def test_the_503_at_the_limit_is_openais_error_with_retry_after(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """The non-streamed answer at the limit, as a client reads it (SIGTERM during a generation
    that request_timeout_s = 120 would let run for minutes)."""
    pid1 = service(config(tmp_path, tiny_gguf))
    long_tokens = _tokens_for(pid1.address, 15.0, together=1)
    plain = Clients(pid1.address, [body(long_tokens, False)], timeout=120).start()
    _until("a slot busy", lambda: metric(pid1.address, "edge_slots_busy", model="tiny") == 1)
    sent = time.monotonic()
    pid1.proc.send_signal(signal.SIGTERM)
    (a,) = plain.wait(60)
    assert a.statuses == [503] and a.whole and a.ended - sent <= DRAIN_S + 2.0
    error = a.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down" and error["param"] is None
    assert "server.drain_timeout_s = 5 s" in error["message"]
    assert pid1.proc.wait(30) == 0


def _stat(pid: str) -> list[str]:
    """/proc/PID/stat's fields after the command (state, ppid, ...); [] for a process gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _new_pid(old: int, timeout: float = 60.0) -> int:
    """The handover's new process: the old one's child, stopped as its warm-up begins (EDGE_TEST_FAULT)."""
    found: list[int] = []

    def stopped() -> bool:
        found[:] = [int(p) for p in os.listdir("/proc") if p.isdigit() and _stat(p)[1:2] == [str(old)]]
        return bool(found) and _stat(str(found[0]))[:1] == ["T"]

    _until("the new process stopped in its warm-up", stopped, timeout)
    return found[0]


def test_a_handover_passes_on_what_waits_and_ends_the_rest_at_the_limit(tmp_path: Path, tiny_gguf: Path,
                                                                          service) -> None:
    cfg = config(tmp_path, tiny_gguf)
    env = {**os.environ, "INVOCATION_ID": "0123456789abcdef0123456789abcdef"}  # the unit's, as ExecReload= has it
    pid1 = service(cfg, env=env)
    old = pid1.proc
    long_tokens = _tokens_for(pid1.address, 25.0)  # past the new process's warm-up and the limit
    # the new process stops as its warm-up begins, until the load is in place: then it goes on,
    # is ready, and the switch comes with 4 generations running and 4 queued in the old process
    reload = subprocess.Popen([*EDGE, "reload", "--config", str(cfg), "--process"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "EDGE_TEST_FAULT": "warmup:STOP"})
    try:
        new = _new_pid(old.pid)
        longs, shorts = _load(pid1.address, long_tokens, retries=0)  # no retry: nothing may need one
        os.kill(new, signal.SIGCONT)
        switch = pid1.wait_for("MAINPID", str(new), pid=old.pid)
        assert old.wait(30) == 0
        assert old.exited_at - switch.at <= DRAIN_S + 2.0, f"exited {old.exited_at - switch.at:.2f} s after the switch"
        out, err = reload.communicate(timeout=120)
        assert reload.returncode == 0, err
    finally:
        if reload.poll() is None:
            reload.kill()
    short = shorts.wait(120)
    for a in short:  # queued at the switch: passed on, answered by the new process as if it had accepted them
        assert a.statuses == [200] and a.whole and a.error_event is None, (a.statuses, a.body[-300:])
        assert a.done if a.streamed else a.json()["usage"]["completion_tokens"] == 16
    for a in longs.wait(300):
        assert a.statuses == [200] and a.whole, (a.statuses, a.error, a.body[-300:])
        if a.streamed:  # running at the limit, its answer begun: its error event, then [DONE]
            assert a.done and a.error_event["code"] == "server_shutting_down", a.body[-300:]
        else:  # running at the limit, nothing sent yet: passed on, and made whole by the new process
            assert a.json()["usage"]["completion_tokens"] == long_tokens
    report = json.loads((tmp_path / "state" / "last-reload.json").read_text())
    assert report["passed_on"] == 6 and report["ended_at_limit"] == 4, report
    log = _old_log(pid1.log_tail(400_000), old.pid)
    assert "drain: 4 requests still running after server.drain_timeout_s = 5 s" in log, log[-3000:]
    _clean(pid1.log_tail(400_000))
    _no_half_closed(pid1.address[1])
    assert pid1.stop() == 0


def test_reloads_and_handovers_under_10_clients_cut_nothing(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """The soak, short (scripts/bench soak is the long one): 10 clients asking one request after
    another (half of them streamed), in-place reloads and handovers while they do: every answer
    a 200, every stream ended with [DONE] (a stream the old process still ran at its limit, on a
    slow machine, says so in its last event before [DONE]: ended, not cut)."""
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=4096, server=f"drain_timeout_s = {DRAIN_S:g}",
                       extra_model="parallel = 4")
    pid1 = service(cfg)
    loop = Loop(pid1.address, 10, lambda i, n: body(8 + (7 * i + 13 * n) % 120, i % 2 == 1, n)).start()
    try:
        for kind in ("in-place", "process", "in-place", "process"):
            loop.wait_count(len(loop.answers) + 20, 120)  # requests in flight as the reload begins
            r = subprocess.run([*EDGE, "reload", "--config", str(cfg), *(["--process"] if kind == "process" else [])],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (kind, r.stderr)
        loop.wait_count(len(loop.answers) + 20, 120)
    finally:
        answers = loop.stop(300)
    bad = [(a.statuses, a.error, a.body[-200:]) for a in answers
           if a.status != 200 or not a.whole or (a.streamed and not a.done)
           or (a.error_event or {"code": "server_shutting_down"})["code"] != "server_shutting_down"]
    assert not bad, bad[:5]
    assert len(answers) >= 100
    assert pid1.stop() == 0


class _Conn:
    """An h11 connection as the drain reads it: a request in progress until `answered`."""

    def __init__(self) -> None:
        self.cycle = type("Cycle", (), {"response_complete": False})()
        self.aborted = False
        self.transport = self

    def abort(self) -> None:
        self.aborted = True


def test_after_the_limit_a_connection_is_closed_only_once_its_model_ended_it_and_it_still_does_not_read() -> None:
    """The step in progress at the limit may outlast LIMIT_GRACE_S (a slow machine, a big model):
    its requests are answered after it, not cut; a connection still in a request LIMIT_GRACE_S
    after the models ended theirs (a client that does not read) is closed."""
    import threading

    from edge.lifecycle.drain import LIMIT_GRACE_S, Drain

    ended = threading.Event()
    stopping = type("D", (), {"stopping": True})()
    drain = Drain(stopping, None, None, None, timeout_s=DRAIN_S)  # type: ignore[arg-type]
    drain.on_limit = lambda: (2, [ended])
    answered, silent = _Conn(), _Conn()
    conns = {answered, silent}
    drain._limit(conns, 100.0)
    assert drain.ended_at_limit == 2
    assert not drain._past_limit(conns, 100.0 + 3 * LIMIT_GRACE_S)  # the step goes on: nothing is cut
    ended.set()
    answered.cycle.response_complete = True  # its answer went out after the step
    assert not drain._past_limit(conns, 100.0 + 3 * LIMIT_GRACE_S)
    assert not silent.aborted
    assert drain._past_limit(conns, 100.0 + 4.01 * LIMIT_GRACE_S)
    assert silent.aborted and not answered.aborted and drain.cut == 1
