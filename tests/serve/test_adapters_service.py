"""LoRA adapters through a real `edge serve` (kit.PidOne, 127.0.0.1, port 0) on the tiny generated
model and tiny generated LoRAs: /v1/models lists them, a request picks them (`model:adapter`,
`lora`), an unknown one is a 400 naming it, 8 concurrent clients with mixed adapters get their own
adapters' answers with no failure and none starved; a damaged adapter stops the start with exit
65; a reload that changes an adapter keeps the model mapped (the same mapping before and after),
under 8 clients, and a reload back restores the previous adapter set."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.ggufgen import write_tiny_lora
from kit import EDGE, get, post, write_config

BODY = {"prompt": "Hello world. The", "max_tokens": 10, "temperature": 0}
CLIENTS = 8
ROUNDS = 4
PICKS = ({}, {"model": "tiny:a"}, {"model": "tiny:b"}, {"lora": [{"name": "a", "scale": 0.5}, {"id": 1}]})


def adapters_toml(a: Path, b: Path) -> str:
    return (f'[[models.adapters]]\nname = "a"\npath = "{a}"\n\n'
            f'[[models.adapters]]\nname = "b"\npath = "{b}"\nscale = 0.75\n')


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("service-loras")
    return {"a": write_tiny_lora(d / "a.gguf", seed=1), "b": write_tiny_lora(d / "b.gguf", seed=2),
            "c": write_tiny_lora(d / "c.gguf", seed=3)}


def text(address: tuple[str, int], pick: dict[str, Any]) -> str:
    status, answer = post(address, "/v1/completions", {**BODY, **pick})
    assert status == 200, answer
    return answer["choices"][0]["text"]


def mapping(pid: int, model: Path) -> list[str]:
    """The model file's mappings in the process (address range and inode): the same after a
    reload that kept the model."""
    return [line.split()[0] + " " + line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if line.endswith(str(model))]


def clients(address: tuple[str, int], stop: threading.Event | None = None) -> list[list[tuple[float, str]]]:
    """8 clients, each on its own selection (i % 4), ROUNDS requests (and on until `stop`): each
    request's seconds and answer. Any failed request fails the test (text() asserts a 200)."""
    def one(i: int) -> list[tuple[float, str]]:
        out: list[tuple[float, str]] = []
        while len(out) < ROUNDS or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            got = text(address, PICKS[i % 4])
            out.append((time.perf_counter() - t0, got))
        return out

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(CLIENTS)))


def test_requests_pick_adapters_and_mixed_clients_all_get_theirs(tmp_path: Path, tiny_gguf: Path,
                                                                  loras: dict[str, Path], service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512,
                       extra_model="parallel = 4\n\n" + adapters_toml(loras["a"], loras["b"]))
    live = service(cfg)
    status, listed = get(live.address, "/v1/models")
    assert status == 200
    ids = [m["id"] for m in listed["data"]]
    assert ids == ["tiny", "tiny:a", "tiny:b"]
    assert [(a["id"], a["name"], a["scale"]) for a in listed["data"][0]["meta"]["adapters"]] == [(0, "a", 1.0), (1, "b", 0.75)]
    want = {i: {text(live.address, p)} for i, p in enumerate(PICKS)}
    assert len({next(iter(w)) for w in want.values()}) == 4  # each selection answers its own way
    assert text(live.address, {"lora": [{"name": "a"}]}) in want[1]  # the same as model "tiny:a"
    assert text(live.address, {"model": "tiny:a", "lora": [{"name": "a", "scale": 0}]}) in want[0]
    for pick, names in (({"model": "tiny:zz"}, "'zz'"), ({"lora": [{"name": "zz"}]}, "'zz'"), ({"lora": [{"id": 7}]}, "7")):
        status, answer = post(live.address, "/v1/completions", {**BODY, **pick})
        assert status == 400 and names in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    runs = clients(live.address)
    for i, run in enumerate(runs):
        assert {got for _, got in run} == want[i % 4], i
    per_client = [sum(t for t, _ in run) for run in runs]
    # none starved: the slowest client's requests took at most a few times the fastest's
    assert max(per_client) < 4 * min(per_client) + 1.0, per_client


def test_a_damaged_adapter_stops_the_start_with_exit_65(tmp_path: Path, tiny_gguf: Path, loras: dict[str, Path]) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(loras["a"].read_bytes()[:3000])
    other = write_tiny_lora(tmp_path / "other.gguf", n_embd=32)
    for bad, words in ((cut, "truncated GGUF"), (other, "llama.cpp refused the LoRA adapter")):
        cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=adapters_toml(loras["a"], bad))
        p = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NOTIFY_SOCKET": ""})
        assert p.returncode == 65, p.stderr[-2000:]
        assert words in p.stderr and str(bad) in p.stderr and "models[0].adapters[1].path" in p.stderr
        assert "Traceback" not in p.stderr


def reload(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EDGE, "reload", "--config", str(cfg)], capture_output=True, text=True, timeout=300)


def test_a_reload_that_changes_an_adapter_keeps_the_model_and_fails_no_request(
        tmp_path: Path, tiny_gguf: Path, loras: dict[str, Path], service) -> None:
    first = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512,
                         extra_model="parallel = 4\n\n" + adapters_toml(loras["a"], loras["b"]))
    second = tmp_path / "edge-c.toml"
    second.write_text(first.read_text().replace(str(loras["b"]), str(loras["c"])))
    live = service(first)
    before = mapping(live.proc.pid, tiny_gguf)
    assert before
    old = {i: text(live.address, p) for i, p in enumerate(PICKS)}
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(clients, live.address, stop)
        try:
            r = reload(second)
        finally:
            stop.set()
        assert r.returncode == 0, r.stdout + r.stderr
        runs = running.result()  # no request failed
    assert mapping(live.proc.pid, tiny_gguf) == before  # the base model was never loaded again
    report = json.loads((tmp_path / "state" / "last-reload.json").read_text())
    assert report["kept"] == ["tiny"] and report["loaded"] == [], report
    new = {i: text(live.address, p) for i, p in enumerate(PICKS)}
    assert new[0] == old[0] and new[1] == old[1] and new[2] != old[2] and new[3] != old[3]
    for i, run in enumerate(runs):  # each answer the old set's or the new one's
        assert {got for _, got in run} <= {old[i % 4], new[i % 4]}, i
    assert sum(len(run) for run in runs) >= CLIENTS * ROUNDS
    r = reload(first)  # a rollback: the previous adapter set back
    assert r.returncode == 0, r.stdout + r.stderr
    assert {i: text(live.address, p) for i, p in enumerate(PICKS)} == old
    assert mapping(live.proc.pid, tiny_gguf) == before


def test_the_start_report_lists_the_adapters_and_a_bad_one_fails_a_reload_leaving_the_old_set(
        tmp_path: Path, tiny_gguf: Path, loras: dict[str, Path], service) -> None:
    """`edge status` shows each adapter with its file and scale; a reload to a config whose
    adapter is damaged fails naming it, and the old set (its adapters too) serves on."""
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512,
                       extra_model="parallel = 4\n\n" + adapters_toml(loras["a"], loras["b"]))
    live = service(cfg)
    status = subprocess.run([*EDGE, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert f"model tiny adapter b: {loras['b']}" in status.stdout and "default scale 0.75" in status.stdout, status.stdout
    before = {i: text(live.address, p) for i, p in enumerate(PICKS)}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(loras["c"].read_bytes()[:3000])
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace(str(loras["b"]), str(cut)))
    r = reload(bad)
    assert r.returncode == 65 and str(cut) in r.stdout + r.stderr, r.stdout + r.stderr
    assert {i: text(live.address, p) for i, p in enumerate(PICKS)} == before
