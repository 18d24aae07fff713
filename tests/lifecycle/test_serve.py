"""`edge serve` as a real subprocess, started the way systemd starts it (kit.PidOne)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit import EDGE, dies_with_us, metric, post, write_config


def _recv_all(conn: socket.socket) -> bytes:
    raw = b""
    while chunk := conn.recv(65536):
        raw += chunk
    return raw


def test_connection_made_before_ready_is_answered_after_warmup(tiny_config: Path, service) -> None:
    t_start = time.monotonic()
    pid1 = service(tiny_config, ready=False)
    # Connect at once: the service has not even imported llama.cpp yet.
    conn = socket.create_connection(pid1.address, timeout=60)
    t_connected = time.monotonic()
    req = json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(req), req))
    raw = _recv_all(conn)
    t_answered = time.monotonic()
    ready = pid1.wait_for("READY", "1")
    # The connection was made before READY=1 was sent. The answer is compared with the
    # service's own clock (offsets from its exec, which came after t_start; /proc's start time
    # has clock-tick resolution), not with the datagram's arrival: READY=1 and the first
    # accept() race by design.
    assert t_connected < ready.at, (t_connected - t_start, ready.at - t_start)
    report = json.loads((tiny_config.parent / "state" / "last-start.json").read_text())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert t_answered - t_start >= report["ready_s"] - tick, (t_answered - t_start, report["ready_s"])
    assert raw.startswith(b"HTTP/1.1 200")
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert body["usage"]["completion_tokens"] >= 1

    statuses = [n.fields.get("STATUS", "") for n in pid1.notifications if n.pid == pid1.proc.pid]
    assert any(s.startswith("warming up") for s in statuses)
    assert statuses.index(next(s for s in statuses if s.startswith("warming up"))) < \
        statuses.index(next(s for s in statuses if s.startswith("ready")))
    assert any("EXTEND_TIMEOUT_USEC" in n.fields for n in pid1.notifications)

    report = json.loads((tiny_config.parent / "state" / "last-start.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    for name in ("config", "sockets", "validate", "page_in", "imports", "model_load",
                 "mlock_verify", "warmup", "ready"):
        assert name in phases, name
    assert phases["sockets"]["detail"]["inherited"] is True
    # llama.cpp's bindings alone before the load (edge.model.bindings), the rest of llama_cpp beside it
    assert phases["imports"]["detail"]["modules"][0] == "llama_cpp.llama_cpp"
    assert phases["imports_http"]["detail"]["modules"][0] == "llama_cpp"
    assert "anyio._backends._asyncio" in phases["imports_http"]["detail"]["modules"]  # not the floor's to import
    warm = phases["warmup"]
    # a CPU model with no plan yet: the floor before READY, the calibration after it (test_warmup)
    assert warm["detail"]["steps"][0]["name"] == "floor" and warm["detail"]["plan"] == "calibrating after ready"
    assert all(s["status"] == 200 for s in warm["detail"]["steps"])
    # READY came after the warm-up finished (same clock: offsets from the service's exec)
    assert report["ready_s"] >= warm["start_s"] + warm["seconds"]
    assert pid1.stop() == 0
    assert "STOPPING" in pid1.notifications[-1].fields


def _exit(config: Path) -> tuple[int, str]:
    p = subprocess.run([*EDGE, "serve", "--config", str(config)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "NOTIFY_SOCKET": ""})
    return p.returncode, p.stderr


@pytest.mark.parametrize("make, code, words", [
    (lambda d, good: (d / "cut.gguf").write_bytes(good.read_bytes()[:5000]), 65, "truncated GGUF"),
    (lambda d, good: (d / "cut.gguf").write_bytes(os.urandom(10000)), 65, "not a GGUF file"),
    (lambda d, good: None, 65, "model file does not exist"),
])
def test_bad_model_files_exit_65_with_a_clear_error(tmp_path: Path, tiny_gguf: Path, make, code, words) -> None:
    make(tmp_path, tiny_gguf)
    rc, err = _exit(write_config(tmp_path / "edge.toml", tmp_path / "cut.gguf"))
    assert rc == code
    assert words in err and str(tmp_path / "cut.gguf") in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text, words", [
    ("[[models]\n", "not valid TOML"),
    ('[[models]]\nname = "x"\npath = "y"\nn_ctxx = 5\n', "models[0].n_ctxx: unknown key"),
    ('[server]\nport = "http"\n[[models]]\nname = "x"\npath = "y"\n', "server.port: expected an integer"),
])
def test_config_errors_exit_78_naming_the_field(tmp_path: Path, text: str, words: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    rc, err = _exit(cfg)
    assert rc == 78 and words in err and str(cfg) in err and "Traceback" not in err


def test_missing_config_file_exits_78(tmp_path: Path) -> None:
    rc, err = _exit(tmp_path / "absent.toml")
    assert rc == 78 and "does not exist" in err


def test_bound_unix_socket_with_mode(tmp_path: Path, tiny_gguf: Path) -> None:
    sock_path = tmp_path / "edge.sock"
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    cfg.write_text(cfg.read_text().replace('port = 0', f'unix_socket = "{sock_path}"\nunix_socket_mode = "0660"'))
    proc = subprocess.Popen(dies_with_us([*EDGE, "serve", "--config", str(cfg)]), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not sock_path.exists():
            time.sleep(0.05)
        assert oct(sock_path.stat().st_mode & 0o777) == "0o660"
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(60)
        s.connect(str(sock_path))  # accepted by the kernel now, answered after warm-up
        s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b'"ready"' in data
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_sigterm_lets_a_streaming_request_finish(tmp_path: Path, tiny_gguf: Path, service) -> None:
    pid1 = service(write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512))
    c = http.client.HTTPConnection(*pid1.address, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True}))
    r = c.getresponse()
    first = r.readline()  # the stream has started
    assert first.startswith(b"data: ")
    pid1.proc.send_signal(signal.SIGTERM)
    rest = r.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert pid1.proc.wait(60) == 0
    stopping = pid1.wait_for("STOPPING", "1")
    assert stopping.pid == pid1.proc.pid


def test_help_and_status_do_not_import_native_or_http_stacks(tiny_config: Path) -> None:
    probe = ("import sys, runpy; sys.argv = ['edge'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('edge.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "heavy = [m for m in ('llama_cpp', 'tensorrt', 'uvicorn', 'starlette', 'numpy') if m in sys.modules]\n"
             "print('HEAVY', heavy, file=sys.stderr)\n")
    for args in (["--help"], ["status", "--config", str(tiny_config)], ["serve", "--help"]):
        p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
        assert "HEAVY []" in p.stderr, (args, p.stderr)


def test_broken_chat_template_is_a_clear_model_error(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model='chat_template = "{% for x in %}"')
    rc, err = _exit(cfg)
    assert rc == 65 and "chat template (models[].chat_template) does not compile" in err
    assert "Traceback" not in err


def test_configured_sha256_is_verified_once_per_file(tmp_path: Path, tiny_gguf: Path, service) -> None:
    import hashlib

    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    wrong = write_config(tmp_path / "wrong.toml", tiny_gguf, extra_model=f'sha256 = "{"0" * 64}"')
    rc, err = _exit(wrong)
    assert rc == 65 and f"sha256 mismatch: expected {'0' * 64}, found {digest}" in err
    good = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=f'sha256 = "{digest}"')
    for expect_hash in (True, False):  # hashed at the first start, remembered for the second
        assert service(good).stop() == 0
        report = json.loads((tmp_path / "state" / "last-start.json").read_text())
        page_in = next(p for p in report["phases"] if p["name"] == "page_in")
        assert ("sha256" in page_in["detail"]) is expect_hash


def test_client_that_goes_away_mid_stream_stops_generation(tmp_path: Path, tiny_gguf: Path, service) -> None:
    pid1 = service(write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512))

    def generated() -> int:
        return int(metric(pid1.address, "edge_completion_tokens_total"))

    _, full = post(pid1.address, "/v1/completions", {"prompt": "Hello", "max_tokens": 480, "temperature": 0})
    assert full["usage"]["completion_tokens"] == 480  # left alone, this request runs to the end
    before = generated()
    s = socket.create_connection(pid1.address, timeout=30)
    body = json.dumps({"prompt": "Hello", "max_tokens": 480, "temperature": 0, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, f"the server closed the stream before its first event: {got!r}"
        got += chunk
    s.close()  # gone after the first chunk
    status, answer = post(pid1.address, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200  # the worker was freed
    deadline = time.monotonic() + 10
    while generated() - before - answer["usage"]["completion_tokens"] <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded polling of the counter the cancelled generation bumps
    assert 0 < generated() - before - answer["usage"]["completion_tokens"] < 480
    assert pid1.stop() == 0


def test_warmup_rehearses_a_start_without_serving(tiny_config: Path) -> None:
    r = subprocess.run([*EDGE, "warmup", "--config", str(tiny_config), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["rehearsal"] is True and report["sockets"] == []
    assert report["warmup"][0]["name"] == "floor"
    assert {"tok1", "short", "decode_stream", "chat"} <= {c["name"] for c in report["calibration"][0]["candidates"]}
    assert not (tiny_config.parent / "state" / "last-start.json").exists()  # nothing pretends it served


def test_bench_measures_a_running_service(tiny_config: Path, service) -> None:
    pid1 = service(tiny_config)
    host, port = pid1.address
    r = subprocess.run([*EDGE, "bench", "--url", f"http://{host}:{port}", "--requests", "12",
                        "--concurrency", "3", "--max-tokens", "3"], capture_output=True, text=True, timeout=120)
    assert pid1.stop() == 0
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["ok"] == 12 and result["errors"] == 0 and 0 < result["p50_s"] <= result["p99_s"]
    assert result["tokens_per_s"] > 0
    bad = subprocess.run([*EDGE, "bench", "--url", "ftp://x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "expected an http:// URL" in bad.stderr
