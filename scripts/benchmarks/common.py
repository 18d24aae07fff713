"""Shared pieces of the benchmarks: the model, novel prompts, edge and its two peers started the
same way, a raw HTTP client.

The servers compared on one model:
- `edge serve`, socket-activated by the harness's PidOne (scripts/harness/pid1.py: the listening socket exists before the
  process, as under systemd: a client's connection waits in the backlog);
- `python -m llama_cpp.server`, llama-cpp-python's own server (binds after the model load);
- `llama-server`, llama.cpp's C++ server built from the llama.cpp that llama-cpp-python vendors
  (scripts/build-llama-server; binds early and answers 503 while it loads).
All three get the same model, n_ctx, threads, n_batch and mmap+mlock; each one's clock starts
just before its process is spawned, and its client connects from then on, retrying while the
connection is refused (or answered 503 "loading").
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.serve.client import request as http  # one request per connection: (status, unchunked body)
from harness import EDGE, PidOne, dies_with_us

ROOT = Path(__file__).resolve().parents[2]  # the checkout: scripts/benchmarks/common.py
PROMPT = "Question: What is the capital of France?\nAnswer:"
REQUEST = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": ["\n"]}

# Plain lowercase words for novel prompts: none starts a warm-up text ("Hello", "The field
# unit ...", a chat turn), and only those that are one token after a space are used.
WORDS = tuple("""
apple river stone cloud forest garden window bridge candle market silver orange basket mirror
pencil rabbit engine harbor island ladder meadow needle ocean pillow rocket saddle tunnel
violin wagon yellow anchor button carpet dragon feather guitar helmet jacket kettle lemon
marble napkin oyster parrot quilt ribbon shadow ticket umbrella valley walnut zipper blanket
camera desert finger hammer insect jungle kitchen lizard magnet nickel orchard planet puzzle
rainbow spider tiger velvet whistle copper summer winter spring autumn morning evening
village castle doctor farmer singer painter sailor teacher baker hunter driver soldier coffee
butter cheese bread honey sugar pepper salt water fire earth wind metal glass paper cotton
wool leather silk iron gold plastic wood brick sand snow rain storm thunder light dark green
blue red black white purple brown gray pink quick slow happy sad loud quiet bright heavy
""".split())


def gemma_path() -> Path:
    """The embedded default model, assembled (and verified) into the repo's .data cache."""
    from edge.config import ModelConfig
    from edge.model.file import VerifiedCache, resolve_model

    cache = ROOT / ".data" / "cache"
    m = resolve_model(ModelConfig(name="gemma3-270m", path="builtin:gemma3-270m"), cache,
                      VerifiedCache(cache / "verified.json"))
    return Path(m.path)


def edge_config(folder: Path, model: Path, n_ctx: int, *, n_threads: int = 0, n_batch: int = 512,
                warmup_prompts: Sequence[str] = (), extra_model: str = "") -> Path:
    """edge's defaults but for the model, context, threads and batch. The warm-up gets no
    measured prompt: a benchmark must never measure what the warm-up has seen."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{folder / "state"}"\ncache_dir = "{folder / "cache"}"\n'
                   f'[[models]]\nname = "gemma"\npath = "{model}"\nn_ctx = {n_ctx}\n'
                   f'n_threads = {n_threads}\nn_batch = {n_batch}\n{extra_model}'
                   f'[warmup]\nprompts = {json.dumps(list(warmup_prompts))}\n')
    return cfg


def novel_prompts(model: Path, n_tokens: int, seeds: Sequence[int]) -> list[str]:
    """One prompt per seed, each exactly n_tokens long (BOS included) in the model's tokenizer,
    of words drawn by the seed; the first word differs for every seed (up to len(WORDS) seeds),
    so no two prompts share a prefix beyond BOS and no server's prefix cache can answer one."""
    from llama_cpp import Llama

    vocab = Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        def count(text: str) -> int:
            return len(vocab.tokenize(text.encode(), add_bos=True, special=False))

        words = [w for w in WORDS if len(vocab.tokenize(b" " + w.encode(), add_bos=False)) == 1]
        if len(set(seeds)) != len(seeds) or len(seeds) > len(words):
            raise ValueError(f"need distinct seeds, at most {len(words)}; got {len(seeds)}")
        out = [_prompt(count, words, seed, n_tokens) for seed in seeds]
    finally:
        vocab.close()
    return out


def _prompt(count: Callable[[str], int], words: list[str], seed: int, n_tokens: int) -> str:
    rng = random.Random(seed)
    parts = [words[seed % len(words)]]
    while (n := count(" ".join(parts))) < n_tokens:
        for _ in range(50):  # a word that overshoots is replaced by another
            if count(" ".join([*parts, w := rng.choice(words)])) <= n_tokens:
                parts.append(w)
                break
        else:
            raise ValueError(f"cannot build a {n_tokens}-token prompt from seed {seed}")
    if n != n_tokens:
        raise ValueError(f"prompt for seed {seed} has {n} tokens, not {n_tokens}")
    return " ".join(parts)


def completion(prompt: str, max_tokens: int) -> dict[str, Any]:
    """Greedy, no stop string: every server does the same prefill and (barring EOS) decode."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": []}


@dataclass(frozen=True)
class Answer:
    seconds: float
    prompt_tokens: int
    completion_tokens: int


def request_until_answered(address: tuple[str, int], body: dict[str, Any], *, deadline_s: float = 300.0,
                           alive: Callable[[], bool] = lambda: True) -> Answer:
    """Connect at once and retry while refused or answered 503 (a server still loading); time to
    the answer. Fails as soon as the server process has exited."""
    t0 = time.monotonic()
    while True:
        try:
            status, payload = http(address, "POST", "/v1/completions", body)
            if status == 200:
                usage = json.loads(payload).get("usage") or {}
                return Answer(time.monotonic() - t0, int(usage.get("prompt_tokens", 0)),
                              int(usage.get("completion_tokens", 0)))
            if status != 503:
                raise RuntimeError(f"HTTP {status} from {address}: {payload[:200]!r}")
        except ConnectionError:
            pass
        if not alive():
            raise RuntimeError(f"the server at {address} exited before answering")
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"no answer from {address} in {deadline_s} s")
        time.sleep(0.005)  # a bounded poll of a real condition: the server is not up yet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Peer:
    """A server other than edge: how to start it on a port and how it says it is ready."""

    name: str
    argv: Callable[[int | str], list[str]]  # the port (or a placeholder, for the report)
    ready_path: str  # GET answers 200 once the model is loaded


def llama_cpp_server(model: Path, n_ctx: int, threads: int, n_batch: int = 512) -> Peer:
    def argv(port: int | str) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
                "--n_threads_batch", str(threads), "--n_batch", str(n_batch), "--use_mmap", "true",
                "--use_mlock", "true"]
    return Peer("llama_cpp.server", argv, "/v1/models")


def llama_server(binary: Path, model: Path, n_ctx: int, threads: int, n_batch: int = 512,
                 parallel: int = 1, extra: Sequence[str] = ()) -> Peer:
    """llama.cpp's server with one slot (the whole n_ctx for one request, as the others have), or
    `parallel` slots sharing n_ctx in one unified KV cache, as edge's slots do; `extra` flags
    after the others (`--embeddings --pooling mean`)."""
    helptext = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    load = ["--load-mode", "mmap+mlock"] if "--load-mode" in helptext else ["--mlock"]
    unified = ["--kv-unified"] if parallel > 1 and "--kv-unified" in helptext else []

    def argv(port: int | str) -> list[str]:
        return [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--ctx-size", str(n_ctx), "--parallel", str(parallel), "--threads", str(threads),
                "--threads-batch", str(threads), "--batch-size", str(n_batch),
                "--ubatch-size", str(n_batch), *unified, *load, *extra]
    return Peer("llama-server", argv, "/health")


@dataclass
class Started:
    """A server process just spawned: its address, pid and the monotonic time of the spawn."""

    name: str
    address: tuple[str, int]
    pid: int
    t0: float
    alive: Callable[[], bool]
    ready_at: Callable[[], float]  # blocks until ready; the monotonic time it became ready

    def ready_s(self) -> float:
        return self.ready_at() - self.t0


@contextmanager
def start_edge(cfg: Path, env: dict[str, str]) -> Iterator[Started]:
    with PidOne([*EDGE, "serve", "--config", str(cfg)], env=env) as pid1:
        t0 = time.monotonic()
        child = pid1.start()
        yield Started("edge", pid1.address, child.pid, t0, lambda: child.poll() is None,
                      lambda: pid1.wait_for("READY", "1", timeout=300).at)
        if (rc := pid1.stop()) != 0:
            raise RuntimeError(f"edge serve exited with {rc}: {pid1.log_tail()}")


@contextmanager
def start_peer(peer: Peer, log: Path) -> Iterator[Started]:
    port = free_port()
    with open(log, "ab") as f:
        t0 = time.monotonic()
        # dies with this process (PR_SET_PDEATHSIG), as the PidOne-started edge serve does
        proc = subprocess.Popen(dies_with_us(peer.argv(port)), stdout=f, stderr=f, stdin=subprocess.DEVNULL)
    address = ("127.0.0.1", port)

    def alive() -> bool:
        return proc.poll() is None

    try:
        yield Started(peer.name, address, proc.pid, t0, alive,
                      lambda: wait_http_ready(address, peer.ready_path, alive))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_http_ready(address: tuple[str, int], path: str, alive: Callable[[], bool],
                    deadline_s: float = 300.0) -> float:
    """Poll GET path until it answers 200; the monotonic time it did."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            if http(address, "GET", path, timeout=30)[0] == 200:
                return time.monotonic()
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"the server at {address} exited before it was ready")
        time.sleep(0.005)  # bounded poll of a real condition
    raise TimeoutError(f"{address}{path} not ready in {deadline_s} s")


def proc_memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmLck"):
            fields[key] = int(val.split()[0]) * 1024
    return {"peak_rss_bytes": fields.get("VmHWM", 0), "rss_bytes": fields.get("VmRSS", 0),
            "locked_bytes": fields.get("VmLck", 0)}


def summary(xs: list[float]) -> dict[str, Any]:
    """Median and spread: min, max and (max - min) / median; P95 and P99 (nearest rank: with
    fewer than 20 values, P95 and P99 are the slowest)."""
    from edge.serve.bench import percentile

    if not xs:
        return {}
    med = statistics.median(xs)
    return {"median": round(med, 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "p50": round(percentile(xs, 0.50), 4), "p95": round(percentile(xs, 0.95), 4),
            "p99": round(percentile(xs, 0.99), 4),
            "spread": round((max(xs) - min(xs)) / med, 3) if med else None, "n": len(xs)}


def emit(result: dict[str, Any], name: str) -> None:
    out = ROOT / ".bench"
    out.mkdir(exist_ok=True)
    text = json.dumps(result, indent=2)
    tmp = out / f".{name}.json.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / f"{name}.json")
    print(text)
    print(f"(also written to {out / (name + '.json')})", file=sys.stderr)


def env_for_bench() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("EDGE_CONFIG", None)
    return env
