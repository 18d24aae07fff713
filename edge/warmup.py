"""Warm-up: representative requests sent through the real ASGI app before READY=1.

The requests go through the same routing, JSON parsing, validation, chat template, generation
and SSE code that client requests take, in process (no socket is accepted yet). The plan covers
a short prompt, a long prefill near the configured context (the biggest batches and most of the
KV cache), several decode steps streamed, the chat template path, and the workload's own prompts.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from edge.config import WarmupConfig
from edge.errors import EdgeError
from edge.llm import GGUFModel

__all__ = ["WarmupStep", "WarmupError", "engine_plan", "plan_for", "run_warmup", "asgi_request"]

# Representative English text for the long prefill; repeated and cut to the token budget.
PASSAGE = ("The field unit reported nominal telemetry for the third consecutive hour. Battery "
           "voltage held at 12.6 volts, the enclosure stayed below forty degrees, and the camera "
           "pipeline processed every frame within its budget. Operators should review the log "
           "summary below and confirm that no anomalies require a maintenance visit. ")


class WarmupError(EdgeError):
    """A warm-up request failed: the model is not fit to serve."""


@dataclass(frozen=True)
class WarmupStep:
    name: str
    path: str
    body: dict[str, Any]


async def asgi_request(app: Any, method: str, path: str, body: dict[str, Any] | None = None
                       ) -> tuple[int, bytes]:
    """One HTTP request to an ASGI app in process: (status, body bytes)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("warmup", 0), "server": ("warmup", 0)}
    sent = False
    done = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # like a client that stays connected until the response ends
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return status, b"".join(chunks)


def _long_prompt(model: GGUFModel, n_tokens: int) -> str:
    one = model.tokenize_prompt(PASSAGE)
    reps = n_tokens // max(1, len(one)) + 2
    tokens = model.tokenize_prompt(PASSAGE * reps)[1:n_tokens]  # drop BOS: the request adds it
    return model.llama.detokenize(tokens).decode("utf-8", "ignore")


def plan_for(model: GGUFModel, cfg: WarmupConfig) -> list[WarmupStep]:
    """The warm-up requests for one model; runs on the model's worker thread (tokenizes)."""
    name = model.cfg.name
    greedy = {"model": name, "temperature": 0.0, "seed": 0}
    decode = min(cfg.decode_tokens, max(1, model.n_ctx // 4))
    steps = [WarmupStep("short", "/v1/completions", {**greedy, "prompt": cfg.short_prompt, "max_tokens": 1})]
    n_long = int(model.n_ctx * cfg.long_prefill_fraction)
    if n_long > 8:
        steps.append(WarmupStep("long_prefill", "/v1/completions",
                                {**greedy, "prompt": _long_prompt(model, n_long), "max_tokens": 1}))
    steps.append(WarmupStep("decode_stream", "/v1/completions",
                            {**greedy, "prompt": cfg.short_prompt, "max_tokens": decode, "stream": True}))
    if cfg.chat and (model.cfg.chat_template or model.info.chat_template):
        steps.append(WarmupStep("chat", "/v1/chat/completions",
                                {**greedy, "max_tokens": min(4, decode),
                                 "messages": [{"role": "user", "content": cfg.short_prompt}]}))
    steps += [WarmupStep(f"prompt_{i}", "/v1/completions", {**greedy, "prompt": p, "max_tokens": decode})
              for i, p in enumerate(cfg.prompts)]
    return steps


def engine_plan(name: str, session: Any) -> list[WarmupStep]:
    """Every optimization profile's min, opt and max shapes (each distinct one once), zeros."""
    steps, seen = [], set()
    for i, prof in enumerate(session.profiles or [{}]):
        for point in ("min", "opt", "max"):
            shapes = {t.name: prof.get(t.name, {}).get(point) or [max(d, 1) for d in t.shape]
                      for t in session.inputs}
            sig = tuple((n, tuple(v)) for n, v in sorted(shapes.items()))
            if sig in seen:
                continue
            seen.add(sig)
            inputs = [{"name": t.name, "shape": shapes[t.name], "datatype": t.datatype,
                       "data": [0] * int(math.prod(shapes[t.name]))} for t in session.inputs]
            steps.append(WarmupStep(f"profile{i}_{point}", f"/v2/models/{name}/infer", {"inputs": inputs}))
    return steps


def _tokens(body: bytes, stream: bool) -> dict[str, Any]:
    if body.startswith(b'{"model_name"'):
        return {"output_shapes": [o["shape"] for o in json.loads(body)["outputs"]]}
    if stream:
        events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        return {"events": len(events)}
    usage = json.loads(body).get("usage", {})
    return {"prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0)}


async def run_warmup(app: Any, steps: list[WarmupStep]) -> list[dict[str, Any]]:
    """Run each step through the app; raise WarmupError on the first one that is not a 200."""
    results = []
    for step in steps:
        t0 = time.perf_counter()
        status, body = await asgi_request(app, "POST", step.path, step.body)
        seconds = time.perf_counter() - t0
        if status != 200 or b'data: {"error"' in body:
            raise WarmupError(f"warm-up step {step.name!r} ({step.path}) failed with HTTP {status}: "
                              f"{body[:300].decode('utf-8', 'replace')}")
        model = step.body.get("model") or step.path.split("/")[3]
        results.append({"name": step.name, "path": step.path, "model": model,
                        "status": status, "seconds": round(seconds, 4),
                        **_tokens(body, bool(step.body.get("stream")))})
    return results
