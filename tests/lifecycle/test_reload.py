"""Zero-gap reload against a real `edge serve` (kit.PidOne: socket activation + notify socket):
clients of every kind keep getting answers while the set behind them is replaced."""

from __future__ import annotations

import http.client
import json
import os
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.ggufgen import write_tiny_llama
from kit import EDGE, post, write_config
from kit.cgroups import MIB, cgroup_tree

from edge.config import parse_config
from edge.errors import ConfigError
from edge.model.gguf import read_gguf_info
from edge.device.memory import MemoryReading
from edge.lifecycle.memguard import decide, estimate
from edge.host.units import UnitOptions, render_service

REQ = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "seed": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models that answer differently (other random weights) and one both sets share."""
    d = tmp_path_factory.mktemp("reload-models")
    return {"a": write_tiny_llama(d / "a.gguf", seed=0), "b": write_tiny_llama(d / "b.gguf", seed=1),
            "keep": write_tiny_llama(d / "keep.gguf", seed=2)}


def configs(tmp_path: Path, models: dict[str, Path], **extra: str) -> tuple[Path, Path]:
    """Config A serves a.gguf as "tiny", config B b.gguf; both serve "keep" from the same file."""
    keep = f'\n[[models]]\nname = "keep"\npath = "{models["keep"]}"\nn_ctx = 256\n'
    return (write_config(tmp_path / "a.toml", models["a"], extra_model=keep, **extra),
            write_config(tmp_path / "b.toml", models["b"], extra_model=keep, **extra))


def answer(address: tuple[str, int]) -> str:
    status, body = post(address, "/v1/completions", REQ)
    assert status == 200, body
    return body["choices"][0]["text"]


def edge_reload(config: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*EDGE, "reload", *(["--config", str(config)] if config else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def last_reload(cfg: Path) -> dict:
    return json.loads((cfg.parent / "state" / "last-reload.json").read_text())


# -- clients -------------------------------------------------------------------------------------
@dataclass
class Client:
    """One client thread: `fresh` (a connection per request), `keepalive` (one connection for
    all requests) or `stream` (SSE, a connection per request); every answer text in order."""

    address: tuple[str, int]
    kind: str
    answers: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # keep-alive: the local port of each request
    errors: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event, progress: threading.Condition) -> None:
        conn = None
        while not stop.is_set():
            try:
                if conn is None or self.kind != "keepalive":
                    conn = http.client.HTTPConnection(*self.address, timeout=60)
                body = {**REQ, "stream": self.kind == "stream"}
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
                self.ports.append(conn.sock.getsockname()[1] if conn.sock else -1)
                if resp.status != 200:
                    self.errors.append(f"HTTP {resp.status}: {raw[:200]!r}")
                else:
                    self.answers.append(_text(raw, self.kind == "stream"))
                if self.kind != "keepalive":
                    conn.close()
            except (OSError, http.client.HTTPException) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                conn = None
            with progress:
                progress.notify_all()


def _text(raw: bytes, stream: bool) -> str:
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    return "".join(e["choices"][0]["text"] for e in events)


class Clients:
    def __init__(self, address: tuple[str, int], kinds: list[str]) -> None:
        self.clients = [Client(address, k) for k in kinds]
        self.stop = threading.Event()
        self.progress = threading.Condition()
        self.threads = [threading.Thread(target=c.run, args=(self.stop, self.progress), daemon=True)
                        for c in self.clients]

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def wait(self, done, timeout: float = 120.0) -> None:
        """Until `done(client)` holds for every client (bounded)."""
        with self.progress:
            assert self.progress.wait_for(lambda: all(done(c) for c in self.clients), timeout), \
                [(c.kind, len(c.answers), c.errors[:2]) for c in self.clients]

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


# -- tests ---------------------------------------------------------------------------------------
def test_reload_under_load_switches_every_client_exactly_once(tmp_path: Path, models, service) -> None:
    cfg_a, cfg_b = configs(tmp_path, models)
    pid1 = service(cfg_a)
    old, new = answer(pid1.address), None
    control = tmp_path / "state" / "control.sock"
    assert stat.S_IMODE(control.stat().st_mode) == 0o600  # only the service user (and root)
    with Clients(pid1.address, ["fresh", "fresh", "keepalive", "keepalive", "stream", "stream"]) as load:
        load.wait(lambda c: len(c.answers) >= 2)  # every kind served by the old set
        before = {id(c): len(c.answers) for c in load.clients}
        r = edge_reload(cfg_b)
        assert r.returncode == 0, r.stderr
        assert "kept: keep; loaded: tiny" in r.stdout, r.stdout
        new = answer(pid1.address)
        load.wait(lambda c: len(c.answers) >= before[id(c)] + 2)  # and then by the new one
    assert old != new, "the two test models must answer differently"
    for c in load.clients:
        assert c.errors == [], (c.kind, c.errors)
        assert set(c.answers) == {old, new}, (c.kind, c.answers)
        switched_at = c.answers.index(new)
        assert c.answers == [old] * switched_at + [new] * (len(c.answers) - switched_at), (c.kind, c.answers)
        if c.kind == "keepalive":  # the same connection went on, on the new set
            assert len(set(c.ports)) == 1, c.ports

    # systemd saw RELOADING=1 (with its monotonic timestamp) before READY=1, from the main pid
    reloading = pid1.wait_for("RELOADING", "1")
    assert int(reloading.fields["MONOTONIC_USEC"]) > 0
    ready = [n for n in pid1.notifications if n.fields.get("READY") == "1" and n.pid == pid1.proc.pid]
    assert len(ready) == 2 and ready[0].at < reloading.at < ready[1].at
    assert ready[1].fields["STATUS"].startswith("ready: serving tiny, keep (reloaded from")

    report = _wait_drained(cfg_a)
    assert report["kind"] == "reload" and report["error"] is None and report["mode"] == "overlap"
    assert report["kept"] == ["keep"] and report["loaded"] == ["tiny"] and report["freed"] == ["tiny"]
    assert report["switch_s"] > 0 and report["drain_s"] >= 0
    phases = [p["name"] for p in report["phases"]]
    for name in ("config", "validate", "memory_guard", "model_load", "warmup", "switch", "drain"):
        assert name in phases, phases
    assert [p["detail"].get("model") for p in report["phases"] if p["name"] == "warmup"] == ["tiny"]
    status = subprocess.run([*EDGE, "status", "--config", str(cfg_a)], capture_output=True, text=True, timeout=60)
    assert "last reload:" in status.stdout and "kept: keep   loaded: tiny" in status.stdout, status.stdout
    as_json = subprocess.run([*EDGE, "status", "--json", "--config", str(cfg_a)], capture_output=True,
                             text=True, timeout=60)
    shown = json.loads(as_json.stdout)
    assert shown["pid"] == shown["last_reload"]["pid"] == pid1.proc.pid and shown["last_reload"]["kept"] == ["keep"]
    assert pid1.stop() == 0
    assert not control.exists()


def _wait_drained(cfg: Path, timeout: float = 60.0) -> dict:
    # the report is written at the switch and again once the old set drained: wait for the second
    deadline = time.monotonic() + timeout
    while True:
        report = last_reload(cfg)
        if report.get("drain_s") is not None or time.monotonic() > deadline:
            return report
        time.sleep(0.05)


def test_failed_reloads_leave_the_old_set_serving(tmp_path: Path, models, service) -> None:
    cfg_a, _ = configs(tmp_path, models)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(models["b"].read_bytes()[:5000])
    long = tmp_path / "long.toml"  # A's models, kept: a prompt that cannot fit them still fails the reload
    long.write_text(cfg_a.read_text().replace("decode_tokens = 4", f'decode_tokens = 4\nprompts = ["{"word " * 400}"]'))
    bad = {
        "prompts": (long, 78, [str(long), "warmup.prompts[0]", "more than the context of model"]),
        "truncated": (write_config(tmp_path / "cut.toml", cut), 65, [str(cut), "truncated GGUF"]),
        "config": (write_config(tmp_path / "typo.toml", models["b"], n_ctx='"big"'), 78,  # type: ignore[arg-type]
                   [str(tmp_path / "typo.toml"), "models[0].n_ctx", "expected an integer"]),
        "warmup": (write_config(tmp_path / "warm.toml", models["b"],
                                extra_model='chat_template = "{{ undefined_fn() }}"'), 70,
                   ["warm-up step 'chat'", "failed with HTTP 400"]),
    }
    pid1 = service(cfg_a)
    old = answer(pid1.address)
    with Clients(pid1.address, ["fresh", "stream"]) as load:
        for name, (cfg, code, words) in bad.items():
            r = edge_reload(cfg)
            assert r.returncode == code, (name, r.returncode, r.stderr)
            for w in words:
                assert w in r.stderr, (name, w, r.stderr)
            assert "Traceback" not in r.stderr
            failed = [n for n in pid1.notifications if n.fields.get("STATUS", "").startswith("reload failed:")]
            assert failed and failed[-1].fields.get("READY") == "1" and words[-1] in failed[-1].fields["STATUS"]
            assert last_reload(cfg_a)["error"] and words[-1] in last_reload(cfg_a)["error"]
            assert answer(pid1.address) == old, name
        n = len(load.clients[0].answers)
        load.wait(lambda c: len(c.answers) >= n + 1)
    for c in load.clients:
        assert c.errors == [] and set(c.answers) == {old}, (c.kind, c.errors, set(c.answers))
    assert pid1.stop() == 0


def test_memory_guard_over_the_limit_reloads_sequentially(tmp_path: Path, models, service) -> None:
    # Test double of the memory reading: a /proc/meminfo-format file that leaves no room.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        1048576 kB\nMemFree:            1024 kB\nMemAvailable:       1024 kB\n")
    cfg_a, cfg_b = configs(tmp_path, models)
    pid1 = service(cfg_a, env={**os.environ, "EDGE_TEST_MEMINFO": str(meminfo)})
    old = answer(pid1.address)
    with Clients(pid1.address, ["fresh", "keepalive", "stream"]) as load:
        load.wait(lambda c: len(c.answers) >= 1)
        before = {id(c): len(c.answers) for c in load.clients}
        r = edge_reload(cfg_b)
        assert r.returncode == 0, r.stderr
        assert "mode: sequential" in r.stdout and "MiB available" in r.stdout, r.stdout
        load.wait(lambda c: len(c.answers) >= before[id(c)] + 1)
    new = answer(pid1.address)
    assert new != old
    for c in load.clients:  # the requests that came during the gap waited, none failed
        assert c.errors == [], (c.kind, c.errors)
    report = _wait_drained(cfg_a)
    assert report["mode"] == "sequential" and "sequential" in report["memory"]["reason"]
    assert report["memory"]["reading"]["source"] == f"{meminfo} MemAvailable"
    assert report["freed"] == ["tiny"]  # freed before the new one was loaded, "keep" was kept
    phases = [p["name"] for p in report["phases"]]
    assert phases.index("drain_old") < phases.index("model_load")

    # A sequential reload that fails after the old set was freed loads that set again.
    # The budget lets the calibration reach the chat step on a busy machine too (the default 1 s
    # can be spent before it, and a step that never runs cannot fail).
    warm_fail = write_config(tmp_path / "warm.toml", models["a"], extra_model='chat_template = "{{ nope() }}"',
                             extra="budget_s = 600.0")
    r = edge_reload(warm_fail)
    assert r.returncode == 70 and "warm-up step 'chat'" in r.stderr, r.stderr
    assert answer(pid1.address) == new
    report = last_reload(cfg_a)
    assert report["rolled_back"] is True and report["mode"] == "sequential" and report["error"]
    assert pid1.stop() == 0


def test_memory_guard_counts_the_services_cgroup_limit(tmp_path: Path, models, service) -> None:
    # Test doubles of the memory reading: plenty of MemAvailable, but the service's cgroup
    # (MemoryMax=64M, as systemd writes it into memory.max) has 4 MiB left.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 8388608 kB\n")
    unit = "/system.slice/edge.service"
    root = cgroup_tree(tmp_path / "cgroup", unit, {unit: {"memory.max": 64 * MIB, "memory.current": 60 * MIB}})
    cfg_a, cfg_b = configs(tmp_path, models)
    pid1 = service(cfg_a, env={**os.environ, "EDGE_TEST_MEMINFO": str(meminfo), "EDGE_TEST_CGROUP_ROOT": str(root)})
    old = answer(pid1.address)
    r = edge_reload(cfg_b)
    assert r.returncode == 0 and "mode: sequential" in r.stdout, (r.stdout, r.stderr)
    assert f"memory.max of cgroup {unit}" in r.stdout, r.stdout
    assert answer(pid1.address) != old
    reading = _wait_drained(cfg_a)["memory"]["reading"]
    assert reading["source"] == f"cgroup {unit} memory.max" and reading["available_mib"] == 4
    assert reading["cgroup"]["limit_mib"] == 64
    assert pid1.stop() == 0


def test_sighup_reloads_the_config_the_service_was_started_with(tmp_path: Path, models, service) -> None:
    cfg_a, cfg_b = configs(tmp_path, models)
    live = tmp_path / "live.toml"
    live.write_text(cfg_a.read_text())
    pid1 = service(live)
    old = answer(pid1.address)
    live.write_text(cfg_b.read_text())  # the operator edits the config, then `kill -HUP`
    after = time.monotonic()
    pid1.proc.send_signal(signal.SIGHUP)
    pid1.wait_count("RELOADING", 1, after=after)
    ready = pid1.wait_count("READY", 1, after=after)[0]
    assert ready.fields["STATUS"].startswith("ready: serving"), ready.fields
    assert answer(pid1.address) != old
    assert pid1.stop() == 0


def test_edge_reload_without_a_service_says_so(tmp_path: Path, models) -> None:
    cfg_a, _ = configs(tmp_path, models)
    r = edge_reload(cfg_a)
    assert r.returncode == 69 and "no edge service answers on" in r.stderr, r.stderr
    assert str(tmp_path / "state" / "control.sock") in r.stderr and "Traceback" not in r.stderr


def test_reload_mode_is_validated() -> None:
    base = '[[models]]\nname = "m"\npath = "/m.gguf"\n[server]\n'
    assert parse_config(base + 'reload = "sequential"').server.reload == "sequential"
    with pytest.raises(ConfigError, match=r"server\.reload: expected one of \['auto', 'overlap', 'sequential'\]"):
        parse_config(base + 'reload = "fast"', source="x.toml")


def test_memory_estimate_from_the_gguf_header(models) -> None:
    from edge.config import ModelConfig

    info = read_gguf_info(models["a"])  # 2 layers, 4 heads of 16 dims, n_ctx 256
    m = ModelConfig(name="a", path=str(models["a"]), n_ctx=256, n_batch=64)
    need = estimate([(m, info, False)])
    row = need.models["a"]
    assert row["kv_cache"] == 2 * 256 * 4 * (16 + 16) * 2  # f16 K and V for every layer
    assert row["model"] == info.data_bytes and row["compute"] > 0 and row["gpu"] == 0
    assert estimate([(m, info, True)]).models["a"]["model"] == 0  # the same file is mapped already
    # test double of the memory reading: room for it, then none
    roomy = MemoryReading(available=8 << 30, total=16 << 30, source="test double")
    tight = MemoryReading(available=need.total, total=16 << 30, source="test double")
    assert decide("auto", need, roomy).mode == "overlap"
    assert decide("auto", need, tight).mode == "sequential"
    assert decide("overlap", need, tight).mode == "overlap"
    assert decide("sequential", need, roomy).mode == "sequential"


def test_unit_reloads_through_edge_reload() -> None:
    text = render_service(UnitOptions(edge="/opt/edge/venv/bin/edge", config="/etc/edge/edge.toml",
                                      start_timeout_s=300))
    reload_line = next(line for line in text.splitlines() if line.startswith("ExecReload="))
    assert reload_line == "ExecReload=/opt/edge/venv/bin/edge reload --config /etc/edge/edge.toml --timeout 285"
    assert "NotifyAccess=all" in text  # a handover: MAINPID= names the new process, its watchdog pings count
