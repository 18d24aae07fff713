"""Warm-up: requests sent through the real HTTP server before READY=1, chosen by measurement.

Every request goes through the HTTP parsing, routing, JSON, validation, chat template,
generation and SSE code that client requests take, over a private socket pair of this process
(`LoopbackHTTP`: no listener; the service's own sockets accept nothing yet).

What a warm-up should contain differs per device and backend (on a CPU a first 512-token
prefill costs what the next one costs; on a GPU the first batch of a shape pays for lazy module
loading, cuBLAS handles, graph capture). So the steps are candidates, and calibration keeps one
only when its first run costs measurably more than a repeat of the same shape with other tokens
(edge.lifecycle.warmup.calibrate). The floor, one light streamed completion through HTTP, tokenizer, sampler and SSE,
always runs first: readiness means one real request has succeeded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge.config import WarmupConfig
from edge.errors import ConfigError, WarmupError
from edge.serve.client import encode_request, parse_response

if TYPE_CHECKING:
    from edge.model.llm import GGUFModel

__all__ = ["Candidate", "LoopbackHTTP", "WarmupStep", "WarmupError", "check_prompts",
           "engine_candidates", "model_candidates", "model_floor", "model_floors", "run_step", "run_steps"]

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
# Prompt texts are cut from this passage, each starting at a different word, so that no prompt
# begins with a token another one began with: llama.cpp's prefix cache cannot shorten a repeat.
PASSAGE = ("The field unit reported nominal telemetry for the third consecutive hour. Battery "
           "voltage held at 12.6 volts, the enclosure stayed below forty degrees, and every camera "
           "pipeline processed each frame within its budget. Operators should review this log "
           "summary before confirming that no anomalies require a maintenance visit; spare fuses, "
           "gaskets, antennas, brackets and cables remain stocked in cabinet seven near Dock "
           "Quarry while weather radar predicts gentle winds, light drizzle, mild humidity.")
WORDS = tuple(dict.fromkeys(w.strip(".,;") for w in PASSAGE.split()))
# Kernel paths change with the batch's row count: CUDA's MMQ/mat-vec switch sits at 32 rows.
SMALL_BATCH_EDGES = (32, 33)
LONG_PREFILL_CTX = 4096  # the long-prefill candidate: long_prefill_fraction of n_ctx, of at most this
# A decoded token costs about as much as this many prefilled ones (CPU, 2 cores, Gemma 270M:
# ~15 ms vs ~1.6 ms): used only to predict whether a candidate fits the budget.
DECODE_WEIGHT = 10


@dataclass(frozen=True)
class WarmupStep:
    """One request; `repeat` is the same shape with other tokens (calibration's second run)."""

    name: str
    path: str
    body: dict[str, Any]
    repeat: dict[str, Any] | None = None


@dataclass(frozen=True)
class Candidate:
    """A step not made yet: `build` makes its two bodies (tokenizing: on the model's thread)."""

    name: str
    path: str
    work: int  # prompt tokens + DECODE_WEIGHT x max_tokens, or tensor elements: for the budget
    build: Callable[[], WarmupStep]


class LoopbackHTTP:
    """The app served to this process alone, by uvicorn's own HTTP protocol (h11, as the service's
    sockets are served): warm-up requests cross the HTTP layer (parsing, h11, chunked SSE
    framing) exactly like client requests.

    Private by construction: there is no listening socket. Each request is a fresh socket pair
    (`socketpair()`: two connected, unnamed descriptors of this process); uvicorn's protocol is
    put on one end as on an accepted connection, the request is written to the other. No other
    process, user or port can reach it, so the warm-up's requests may pass the API keys (they
    carry the warm-up mark of `warmup_transport`, which no client can send). Nothing is held
    between requests, so nothing is left open whichever way the warm-up ends: `close()` (or
    leaving `async with`) waits for the requests still running and closes their connections.
    The service's own sockets are not touched: they accept nothing until READY."""

    def __init__(self, app: Any) -> None:
        import functools

        import uvicorn
        from uvicorn.server import ServerState

        from edge.serve.warmscope import warmup_transport

        # its requests are marked warm-up, apart from production
        config = uvicorn.Config(warmup_transport(app), loop="asyncio", http="h11", lifespan="off",
                                log_config=None, log_level="warning", access_log=False)
        config.load()
        self._state = ServerState()
        self._protocol = functools.partial(config.http_protocol_class, config=config,
                                           server_state=self._state, app_state={})
        self.closed = False

    async def __aenter__(self) -> "LoopbackHTTP":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """No more requests; those still running end with their generation (cancelled by the
        loop's shutdown instead, uvicorn would log them as ASGI application errors); then every
        connection is closed."""
        self.closed = True
        if self._state.tasks:
            await asyncio.wait(set(self._state.tasks))
        for conn in list(self._state.connections):
            conn.transport.close()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """One request on its own connection: (status, body with chunked framing removed)."""
        import socket

        if self.closed:
            raise WarmupError(f"warm-up request {method} {path} after the warm-up's transport was closed")
        ours, theirs = socket.socketpair()
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._protocol, theirs)
            reader, writer = await asyncio.open_connection(sock=ours)
        except BaseException:
            ours.close()
            theirs.close()
            raise
        try:
            writer.write(encode_request(method, path, body))
            raw = await reader.read()
        finally:
            writer.close()
        return parse_response(raw)


class _Texts:
    """Prompt texts of an exact token count, each starting with a first token no earlier text
    of this set started with. Runs on the model's worker thread (it tokenizes)."""

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.used: list[tuple[int, ...]] = []
        self.made: set[str] = set()
        self.next_word = 0

    def _count(self, text: str) -> int:
        return len(self.model.tokenize_prompt(text))  # as a request counts it: BOS included

    def _word(self, i: int) -> tuple[int, ...]:
        return tuple(self.model.tokenize_text(WORDS[i]))

    def _start(self) -> int:
        """An unused word that shares the shortest token prefix with the previous text's first
        word: none where the vocabulary has whole words (Gemma), only the dummy-prefix bytes of
        a byte-level one."""
        if len(self.used) >= len(WORDS):
            self.used.clear()  # every word has started a text: a new round
        taken = set(self.used)
        order = [i for i in ((self.next_word + k) % len(WORDS) for k in range(len(WORDS)))
                 if self._word(i) not in taken]

        def overlap(i: int) -> int:  # llama.cpp's cache holds the last request: compare with it
            return _shared(self._word(i), self.used[-1]) if self.used else 0
        pick = min(order, key=overlap)  # min keeps the first of equals: the rotation order
        self.used.append(self._word(pick))
        self.next_word = (pick + 1) % len(WORDS)
        return pick

    def make(self, n: int) -> str:
        """A text a request counts as `n` tokens (BOS included), cut at a token boundary, never
        one this set made before."""
        text = self._make(n)
        self.made.add(text)
        return text

    def _make(self, n: int) -> str:
        start = self._start()
        words = WORDS[start:] + WORDS[:start]
        reps = n // max(1, self._count(" ".join(words))) + 2
        full = self.model.tokenize_prompt(" ".join(words * reps))  # BOS first
        take, text = n, ""
        for _ in range(8):  # detokenize-retokenize may merge or split a token at the cut
            raw = self.model.native.detokenize(full[1:take]).decode("utf-8", "ignore")
            text = raw.lstrip(" \u2581")  # a byte-level vocabulary hands back its space mark
            got = self._count(text)
            if got == n and text not in self.made:
                return text
            take = max(1, take + n - got)
        # a cut that never lands (a short text in a byte-level vocabulary): words, then single
        # vocabulary entries, that a request counts as n tokens
        phrases = (" ".join(words[k:j]) for k in range(len(words)) for j in range(k + 1, min(len(words), k + n + 1)))
        pieces = (self.model.token_bytes(t).decode("utf-8", "ignore").strip()
                  for t in range(self.model.n_vocab))
        for p in itertools.chain(phrases, pieces):
            if p and p not in self.made and self._count(p) == n:
                return p
        return text


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _sampled(model: GGUFModel) -> dict[str, Any]:
    # sampling as clients use it (temperature > 0: the whole top-k/top-p chain), reproducible
    return {"model": model.cfg.name, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 0}


def model_floor(model: GGUFModel, cfg: WarmupConfig) -> WarmupStep:
    """What always runs: the short prompt, streamed, two tokens sampled."""
    return WarmupStep("floor", COMPLETIONS, {**_sampled(model), "prompt": cfg.short_prompt,
                                             "max_tokens": 2, "stream": True})


def model_floors(model: GGUFModel, cfg: WarmupConfig) -> tuple[WarmupStep, tuple[WarmupStep, ...]]:
    """The floor, and the floors of the model's other routes: with an embeddings context
    (edge.model.embed) the short prompt embedded too, so readiness means that route has
    answered once as well."""
    embed = WarmupStep("embeddings_floor", EMBEDDINGS, {"model": model.cfg.name, "input": cfg.short_prompt})
    return model_floor(model, cfg), (embed,) if model.embed is not None else ()


def _embeddings_candidates(model: GGUFModel, texts: _Texts) -> list[Candidate]:
    """The embeddings context's shapes: one short input, a batch of 8 inputs filling it, and one
    input as long as its batch (the graph llama.cpp builds differs with rows and sequences)."""
    ctx = model.embed
    if ctx is None:
        return []

    def pair(name: str, sizes: list[int]) -> Candidate:
        def build() -> WarmupStep:
            def body() -> dict[str, Any]:
                return {"model": model.cfg.name, "input": [texts.make(n) for n in sizes]}
            return WarmupStep(name, EMBEDDINGS, body(), body())
        return Candidate(name, EMBEDDINGS, sum(sizes), build)

    k = min(8, ctx.n_seq)
    return [pair("embed_short", [3]), pair(f"embed_batch{k}", [max(2, ctx.n_batch // k)] * k),
            pair("embed_long", [ctx.n_batch])]


def model_candidates(model: GGUFModel, cfg: WarmupConfig) -> list[Candidate]:
    """Every candidate for one model, cheapest paths first, then by prompt length. Runs on the
    model's worker thread, as do the `build`s: a candidate's texts are made only when it runs."""
    texts = _Texts(model)
    sampled = _sampled(model)
    decode = min(cfg.decode_tokens, max(1, model.n_ctx // 4))
    fits = model.n_ctx - decode - 1

    def pair(name: str, path: str, n_total: int, max_tokens: int, stream: bool = False,
             first: str | None = None, n: int = 1) -> Candidate:
        def body(text: str) -> dict[str, Any]:
            key = "messages" if path == CHAT else "prompt"
            value = [{"role": "user", "content": text}] if path == CHAT else text
            return {**sampled, key: value, "max_tokens": max_tokens, **({"stream": True} if stream else {}),
                    **({"n": n} if n > 1 else {})}

        def build() -> WarmupStep:
            one = body(first if first is not None else texts.make(n_total))
            return WarmupStep(name, path, one, body(texts.make(n_total)))
        return Candidate(name, path, n_total + DECODE_WEIGHT * max_tokens, build)

    short = len(model.tokenize_prompt(cfg.short_prompt))
    steps = [pair("tok1", COMPLETIONS, 2, 1), pair("short", COMPLETIONS, max(short, 3), 1),
             pair("decode_stream", COMPLETIONS, max(short, 3), decode, stream=True)]
    if cfg.chat and (model.cfg.chat_template or model.info.chat_template):
        steps += [pair("chat", CHAT, 8, min(4, decode)), pair("chat_stream", CHAT, 8, min(4, decode), True)]
    # batched decode: k sequences per step (k choices of one prompt, edge.model.slots) runs graph
    # shapes a single sequence never does; one candidate per k the slots can hold
    steps += [pair(f"batch{k}", COMPLETIONS, max(short, 3), decode, n=k)
              for k in range(2, min(model.native.n_seq, model.cfg.max_choices) + 1)]
    sized: list[tuple[int, Candidate]] = []
    for i, n in enumerate(check_prompts(model, cfg)):
        sized.append((n, pair(f"prompt_{i}", COMPLETIONS, n, decode, first=cfg.prompts[i])))
    for n in sorted(set(_prompt_lengths(model, cfg))):
        if 3 <= n <= fits:
            sized.append((n, pair(f"len{n}", COMPLETIONS, n, 1)))
    return steps + [s for _, s in sorted(sized, key=lambda x: x[0])] + _embeddings_candidates(model, texts)


def check_prompts(model: GGUFModel, cfg: WarmupConfig, source: str = "<config>") -> list[int]:
    """Each workload prompt's length in tokens; ConfigError (of the config file `source`) when
    one cannot be served with decode_tokens in the model's context (whatever the plan)."""
    decode = min(cfg.decode_tokens, max(1, model.n_ctx // 4))
    lengths = [len(model.tokenize_prompt(p)) for p in cfg.prompts]
    for i, n in enumerate(lengths):
        if n + decode > model.n_ctx:
            raise ConfigError(source, f"warmup.prompts[{i}]", f"is {n} tokens; with {decode} to generate that is "
                              f"more than the context of model {model.cfg.name!r} ({model.n_ctx} tokens)")
    return lengths


def _prompt_lengths(model: GGUFModel, cfg: WarmupConfig) -> list[int]:
    """Batch row counts around each kernel-path edge: below, at and above n_ubatch and n_batch."""
    params = model.native.params
    edges = {int(params.n_ubatch), int(params.n_batch)}
    out = [*SMALL_BATCH_EDGES] + [e + d for e in edges for d in (-1, 0, 1)]
    # of n_ctx, at most LONG_PREFILL_CTX: a context sized to the model (32,768 tokens) is not a prompt's length
    n_long = int(min(model.n_ctx, LONG_PREFILL_CTX) * cfg.long_prefill_fraction)
    return out + ([n_long] if n_long > 8 else [])


def engine_candidates(name: str, session: Any) -> list[Candidate]:
    """Every optimization profile's min, opt and max shapes (each distinct one once); the first is
    the engine's floor. A repeat sends ones where the first sent zeros."""
    out, seen = [], set()
    for i, prof in enumerate(session.profiles or [{}]):
        for point in ("min", "opt", "max"):
            shapes = {t.name: prof.get(t.name, {}).get(point) or [max(d, 1) for d in t.shape]
                      for t in session.inputs}
            sig = tuple((n, tuple(v)) for n, v in sorted(shapes.items()))
            if sig in seen:
                continue
            seen.add(sig)

            def body(fill: int, shapes: dict[str, list[int]] = shapes) -> dict[str, Any]:
                return {"inputs": [{"name": t.name, "shape": shapes[t.name], "datatype": t.datatype,
                                    "data": [fill] * int(math.prod(shapes[t.name]))} for t in session.inputs]}
            step = WarmupStep(f"profile{i}_{point}", f"/v2/models/{name}/infer", body(0), body(1))
            out.append(Candidate(step.name, step.path, sum(int(math.prod(v)) for v in shapes.values()),
                                 lambda step=step: step))
    return out


def _tokens(body: bytes, stream: bool) -> dict[str, Any]:
    if body.startswith(b'{"model_name"'):
        return {"output_shapes": [o["shape"] for o in json.loads(body)["outputs"]]}
    if stream:
        events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        return {"events": len(events)}
    usage = json.loads(body).get("usage", {})
    return {"prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0)}


async def run_step(http: LoopbackHTTP, name: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request over the private HTTP transport, timed; WarmupError when it is not a 200."""
    t0 = time.perf_counter()
    status, data = await http.request("POST", path, body)
    seconds = time.perf_counter() - t0
    if status != 200 or b'data: {"error"' in data:
        raise WarmupError(f"warm-up step {name!r} ({path}) failed with HTTP {status}: "
                          f"{data[:300].decode('utf-8', 'replace')}")
    model = body.get("model") or path.split("/")[3]
    return {"name": name, "path": path, "model": model, "status": status, "seconds": round(seconds, 4),
            **_tokens(data, bool(body.get("stream")))}


async def run_steps(http: LoopbackHTTP, steps: list[dict[str, Any]], budget_s: float
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A stored plan's steps in order while their calibrated first-run times fit the budget:
    (what ran, what did not fit)."""
    ran, left_out, planned = [], [], 0.0
    for s in steps:
        planned += float(s.get("first_s", 0.0))
        if planned > budget_s:
            left_out.append({"name": s["name"], "why": f"over budget ({planned:.2f} s > {budget_s:.2f} s)"})
            continue
        ran.append(await run_step(http, s["name"], s["path"], s["body"]))
    return ran, left_out
