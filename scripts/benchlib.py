"""Shared pieces of the benchmarks: the model, servers (edge and the peer), a raw HTTP client."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from edge.httpwire import request as http  # one request per connection: (status, unchunked body)

ROOT = Path(__file__).resolve().parent.parent
EDGE = [sys.executable, "-m", "edge.cli"]
PROMPT = "Question: What is the capital of France?\nAnswer:"
REQUEST = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": ["\n"]}


def gemma_path() -> Path:
    """The embedded default model, assembled (and verified) into the repo's .data cache."""
    from edge.config import ModelConfig
    from edge.modelfile import VerifiedCache, resolve_model

    cache = ROOT / ".data" / "cache"
    m = resolve_model(ModelConfig(name="gemma3-270m", path="builtin:gemma3-270m"), cache,
                      VerifiedCache(cache / "verified.json"))
    return Path(m.path)


def edge_config(folder: Path, model: Path, n_ctx: int) -> Path:
    """edge's defaults, but for the model, the context and the workload's prompt in the warm-up."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{folder / "state"}"\ncache_dir = "{folder / "cache"}"\n'
                   f'[[models]]\nname = "gemma"\npath = "{model}"\nn_ctx = {n_ctx}\n'
                   f'[warmup]\nprompts = [{json.dumps(PROMPT)}]\n')
    return cfg




def request_until_answered(address: tuple[str, int], body: dict, deadline_s: float = 300.0) -> float:
    """Connect at once and retry while refused (the peer binds late); time to the answer."""
    t0 = time.monotonic()
    while True:
        try:
            status, payload = http(address, "POST", "/v1/completions", body)
            if status == 200:
                json.loads(payload)
                return time.monotonic() - t0
            raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
        except (ConnectionRefusedError, ConnectionResetError):
            if time.monotonic() - t0 > deadline_s:
                raise
            time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_command(model: Path, port: int, n_ctx: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx)]


def start_peer(model: Path, port: int, n_ctx: int, log: Path) -> subprocess.Popen[bytes]:
    f = open(log, "ab")
    return subprocess.Popen(peer_command(model, port, n_ctx), stdout=f, stderr=f, stdin=subprocess.DEVNULL)


def wait_peer_up(address: tuple[str, int], proc: subprocess.Popen[bytes], deadline_s: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited with {proc.returncode}")
        try:
            if http(address, "GET", "/v1/models", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise TimeoutError("peer did not come up")


def proc_memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmLck"):
            fields[key] = int(val.split()[0]) * 1024
    return {"peak_rss_bytes": fields.get("VmHWM", 0), "rss_bytes": fields.get("VmRSS", 0),
            "locked_bytes": fields.get("VmLck", 0)}


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4), "n": len(xs)} if xs else {}


def emit(result: dict[str, Any], name: str) -> None:
    out = ROOT / ".bench"
    out.mkdir(exist_ok=True)
    text = json.dumps(result, indent=2)
    (out / f"{name}.json").write_text(text + "\n")
    print(text)
    print(f"(also written to {out / (name + '.json')})", file=sys.stderr)


def env_for_bench() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("EDGE_CONFIG", None)
    return env
