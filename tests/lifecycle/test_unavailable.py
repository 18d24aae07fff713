"""A give-up that sticks, and answers (edge.fleet.giveup, edge.lifecycle.unavailable), through a real
`edge serve` on kit.PidOne's held socket with what systemd adds (kit.unit: ExecStopPost=,
Restart=on-failure): an unconditional native crash ends in one process that answers every
request at once with a 503 naming why, is seen by every later start before llama.cpp is
imported, and ends by itself when something changed (safe-mode clear, the config) or after
its retry interval, with the interval doubled when the retry crashes too."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from kit import EDGE, PidOne, metric, post, write_config
from kit.unit import Unit

ASK = {"prompt": "hello", "max_tokens": 2}
SEGV = -signal.SIGSEGV


@pytest.fixture(autouse=True)
def _home(edge_home: Path) -> Path:
    return edge_home


def _unit(tmp_path: Path, tiny_gguf: Path, fault: str | None, server: str = "") -> Unit:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    if server:
        cfg.write_text(cfg.read_text().replace("port = 0", "port = 0\n" + server))
    env = {**os.environ, **({"EDGE_TEST_FAULT": fault} if fault else {})}
    return Unit(PidOne([*EDGE, "serve", "--config", str(cfg)], env=env), cfg)


def _ask(address: tuple[str, int], method: str = "POST", path: str = "/v1/completions") -> tuple[int, dict, dict]:
    """status, headers, JSON body."""
    c = http.client.HTTPConnection(*address, timeout=60)
    try:
        c.request(method, path, body=json.dumps(ASK) if method == "POST" else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
    finally:
        c.close()


def _given_up(unit: Unit, max_starts: int = 5) -> None:
    """Start until a process is ready: the crashes, then the one that gave up."""
    assert unit.start_until_ready(max_starts)
    ready = [n for n in unit.pid1.notifications if "READY" in n.fields][-1]
    assert ready.fields["STATUS"].startswith("GIVEN UP: safe mode exhausted"), ready.fields


def _status(config: Path) -> dict:
    r = subprocess.run([*EDGE, "status", "--json", "--config", str(config)], capture_output=True, text=True,
                       timeout=60)
    return json.loads(r.stdout)


def test_an_unconditional_crash_gives_up_once_and_every_request_is_answered_503(tmp_path: Path,
                                                                                 tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV")  # with and without extra buffer types
    with unit.pid1:
        _given_up(unit)
        # two crashes on the full path, one with safe mode's only step (no extra buffer types)
        assert [e.returncode for e in unit.exits] == [SEGV] * 3
        status, headers, body = _ask(unit.pid1.address)
        assert status == 503 and 1 <= int(headers["retry-after"]) <= 600 and headers["connection"] == "close"
        error = body["error"]
        assert (error["code"], error["phase"], error["signal"], error["target"]) == ("given_up", "warmup", "SEGV", "tiny")
        assert "safe mode exhausted: phase warmup (tiny) crashed again (SIGSEGV) with its last fallback" \
               in error["message"]
        assert _ask(unit.pid1.address, "GET", "/readyz")[0] == 503
        health = _ask(unit.pid1.address, "GET", "/healthz")
        assert health[0] == 200 and health[2]["status"] == "given_up"
        assert metric(unit.pid1.address, "edge_given_up", phase="warmup", signal="SEGV", target="tiny") == 1
        assert metric(unit.pid1.address, "edge_ready") == 0  # scraped and not ready: given up, not silent
        assert metric(unit.pid1.address, "edge_build_info") == 1 and metric(unit.pid1.address, "edge_device_info") == 1
        assert metric(unit.pid1.address, "edge_starts_total", result="given_up") == 1
        assert metric(unit.pid1.address, "edge_crashes_total", phase="warmup", cause="native-fault") == 3
        assert unit.stop().returncode == 0
        # the next start sees the give-up before importing llama.cpp: no crash, the same answer
        assert unit.start_once()
        assert _ask(unit.pid1.address)[0] == 503
        assert unit.stop().returncode == 0
    assert [e.returncode for e in unit.exits] == [SEGV] * 3 + [0, 0]
    status = _status(unit.config)
    assert status["given_up"]["phase"] == "warmup" and len(status["given_up"]["crashes"]) == 3
    assert len(status["crashed_starts"]) == 3
    text = subprocess.run([*EDGE, "status", "--config", str(unit.config)], capture_output=True, text=True,
                          timeout=60).stdout
    assert "GIVEN UP since" in text and "`edge safe-mode clear`" in text and "native-fault" in text, text
    doctor = subprocess.run([*EDGE, "doctor", "--config", str(unit.config)], capture_output=True, text=True,
                            timeout=120)
    assert "[FAIL] given up" in doctor.stdout and "edge safe-mode clear" in doctor.stdout, doctor.stdout
    given_up_start = status["last_failed_start"]  # no llama.cpp imported, no model loaded
    assert given_up_start["result"] == "given_up"
    assert [p["name"] for p in given_up_start["phases"]] == ["config", "recovery", "sockets"]


def test_safe_mode_clear_ends_the_give_up_and_a_client_connecting_after_it_is_served(tmp_path: Path,
                                                                                     tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV")
    with unit.pid1:
        _given_up(unit)
        given_up = unit.pid1.proc
        del unit.pid1.env["EDGE_TEST_FAULT"]  # the fix
        r = subprocess.run([*EDGE, "safe-mode", "clear", "--config", str(unit.config)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "the give-up ended" in r.stdout, r.stdout + r.stderr
        answer: dict = {}
        client = threading.Thread(target=lambda: answer.update(r=post(unit.pid1.address, "/v1/completions", ASK,
                                                                      timeout=300)))
        client.start()  # connects after the clear: never accepted by the process that gave up
        assert given_up is not None and given_up.wait(30) == 0  # it ends by itself, exit 0
        unit.stop_post(0)
        assert unit.start_once()  # what socket activation does for the waiting client
        client.join(300)
        assert answer["r"][0] == 200
        assert metric(unit.pid1.address, "edge_given_up") == 0
        unit.stop()
    assert _status(unit.config)["given_up"] is None and _status(unit.config)["safe_mode"] == []


def test_a_changed_config_ends_the_give_up_and_the_full_path_is_tried(tmp_path: Path, tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV")
    with unit.pid1:
        _given_up(unit)
        given_up = unit.pid1.proc
        del unit.pid1.env["EDGE_TEST_FAULT"]
        unit.config.write_text(unit.config.read_text() + "\n# changed\n")
        assert given_up is not None and given_up.wait(30) == 0  # its periodic check saw the new config
        unit.stop_post(0)
        assert unit.start_once()
        last = json.loads((tmp_path / "state" / "last-start.json").read_text())
        assert "safe_mode" not in last and last["models"][0]["context"]["use_extra_bufts"] is not False
        unit.stop()


def test_after_the_retry_interval_one_start_retries_and_a_crash_doubles_the_interval(tmp_path: Path,
                                                                                      tiny_gguf: Path) -> None:
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV", server="give_up_retry_s = 1\nhealthy_after_s = 1")
    record = tmp_path / "state" / "given-up.json"
    with unit.pid1:
        _given_up(unit)
        first = json.loads(record.read_text())
        assert (first["round"], first["retry_s"]) == (1, 1.0)
        assert unit.pid1.proc is not None and unit.pid1.proc.wait(30) == 0  # the interval passed
        unit.stop_post(0)
        _given_up(unit, max_starts=2)  # the retry crashed (with the step in force), then gave up again
        assert [e.returncode for e in unit.exits] == [SEGV] * 3 + [0, SEGV]
        second = json.loads(record.read_text())
        assert (second["round"], second["retry_s"], second["retrying"]) == (2, 2.0, False)
        assert unit.pid1.proc.wait(30) == 0
        unit.stop_post(0)
        del unit.pid1.env["EDGE_TEST_FAULT"]  # fixed meanwhile: the retry serves, in safe mode
        assert unit.start_once()
        assert post(unit.pid1.address, "/v1/completions", ASK)[0] == 200
        _wait_gone(record)  # served healthy_after_s: the give-up is over
        unit.stop()


def _wait_gone(path: Path, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while path.exists():
        assert time.monotonic() < deadline, f"{path} is still there"
        threading.Event().wait(0.05)


def test_the_given_up_process_keys_metrics_as_the_service_does(tmp_path: Path, tiny_gguf: Path) -> None:
    """API keys configured (metrics_auth = "key", the default): the given-up process answers a
    scrape without a key 401, with one the fleet families; /healthz stays open."""
    from kit import call

    key = "sk-given-up-" + "9" * 24
    keys = tmp_path / "api-keys"
    keys.write_text(key + "\n")
    keys.chmod(0o600)
    unit = _unit(tmp_path, tiny_gguf, "warmup:SEGV", server=f'api_key_file = "{keys}"')
    with unit.pid1:
        _given_up(unit)
        assert call(unit.pid1.address, "GET", "/metrics")[0] == 401
        assert call(unit.pid1.address, "GET", "/metrics", headers={"x-api-key": "sk-wrong-" + "0" * 24})[0] == 401
        status, text = call(unit.pid1.address, "GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert status == 200 and 'edge_given_up{phase="warmup"' in text
        assert _ask(unit.pid1.address, "GET", "/healthz")[0] == 200
        assert unit.stop().returncode == 0
