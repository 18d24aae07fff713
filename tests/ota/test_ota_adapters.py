"""LoRA adapters by OTA (issue 55): a thin bundle that changes an adapter carries the adapter alone
(the model listed, not carried), installs, and activates by a reload that keeps the base model
loaded (the same mapping before and after, `kept: [m]`) under 8 clients with no failed request;
`edge ota rollback --reload` restores the previous adapter set, the model still the same mapping."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import threading
from pathlib import Path

from harness.ggufgen import write_tiny_lora
from kit import EDGE, PidOne, post
from kit.ota import cfg_text, edge_ota

CLIENTS = 8
BODY = {"prompt": "Hello world. The", "max_tokens": 8, "temperature": 0}


def _build(kit, version: str, adapter: Path, out: Path, base: Path | None = None) -> subprocess.CompletedProcess:
    config = kit["dir"] / f"cfg-{version}.toml"
    config.write_text(cfg_text("a.gguf", f'[paths]\nstate_dir = "{kit["dir"] / "state"}"\n'
                                         f'[server]\nmax_queue = 64\n').replace(
        "n_ctx = 256\n", f'n_ctx = 256\nparallel = 4\n[[models.adapters]]\nname = "tone"\npath = "adapters/{adapter.name}"\n', 1))
    model = kit["dir"] / "models" / "a.gguf"
    model.parent.mkdir(exist_ok=True)
    if not model.exists():
        model.write_bytes(kit["a"].read_bytes())
    argv = [*EDGE, "ota", "build", "--version", version, "--key", str(kit["key"]), "--config", str(config),
            "--model", str(model), "--adapter", str(adapter), "-o", str(out), *(["--base", str(base)] if base else [])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _text(address: tuple[str, int], model: str) -> str:
    status, answer = post(address, "/v1/completions", {**BODY, "model": model})
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _maps(pid: int) -> list[str]:
    return sorted(line.split()[0] + " " + line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if line.endswith("a.gguf"))


def _under_load(address: tuple[str, int], work) -> tuple[object, list[str]]:
    """`work()` while 8 clients (base and adapter, alternately) send requests; their answers."""
    stop, answers = threading.Event(), []

    def client(i: int) -> None:
        while not stop.is_set():
            answers.append(_text(address, "m:tone" if i % 2 else "m"))

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        running = [pool.submit(client, i) for i in range(CLIENTS)]
        try:
            result = work()
        finally:
            stop.set()
        for r in running:
            r.result()  # a failed request fails here
    return result, answers


def test_a_thin_adapter_bundle_reloads_without_loading_the_model_and_rolls_back(kit) -> None:
    d = kit["dir"]
    one, two = write_tiny_lora(d / "tone-1.gguf", seed=5), write_tiny_lora(d / "tone-2.gguf", seed=6)
    full, thin = d / "v1.edgeb", d / "v2-thin.edgeb"
    assert _build(kit, "1.0.0", one, full).returncode == 0
    r = _build(kit, "1.1.0", two, thin, base=full)
    assert r.returncode == 0, r.stderr
    shown = subprocess.run([*EDGE, "ota", "inspect", str(thin), "--pubkey", str(kit["pub"])],
                           capture_output=True, text=True, timeout=120).stdout
    rows = [line.split() for line in shown.splitlines() if line.startswith("  ") and line.split()[0] in ("ok", "dev")]
    assert sorted((r[0], r[-1]) for r in rows) == [("dev", "models/a.gguf"), ("ok", "adapters/tone-2.gguf")], shown
    assert thin.stat().st_size < full.stat().st_size / 2
    r = edge_ota(kit, "install", str(full), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr
    assert edge_ota(kit, "commit").returncode == 0
    with PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")]) as live:
        live.start()
        live.wait_for("READY", "1")
        pid, before = live.proc.pid, _maps(live.proc.pid)
        base, old = _text(live.address, "m"), _text(live.address, "m:tone")
        r, answers = _under_load(live.address, lambda: edge_ota(
            kit, "install", str(thin), "--pubkey", str(kit["pub"]), "--reload", "--timeout", "120"))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["reload"]["kept"] == ["m"] and json.loads(r.stdout)["reload"]["loaded"] == []
        assert live.proc.pid == pid and _maps(pid) == before  # the base model never loaded again
        new = _text(live.address, "m:tone")
        assert new != old and _text(live.address, "m") == base
        assert len(answers) >= CLIENTS and set(answers) <= {base, old, new}
        r, _ = _under_load(live.address, lambda: edge_ota(kit, "rollback", "--reload", "--timeout", "120"))
        assert r.returncode == 0, r.stderr
        assert _text(live.address, "m:tone") == old and _maps(pid) == before
