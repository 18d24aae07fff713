"""Warm-up: representative requests sent through the real HTTP server before READY=1.

The requests go through the same HTTP parsing, routing, JSON parsing, validation, chat template,
generation and SSE code that client requests take, on a private loopback socket (the service's
own sockets accept nothing yet). The plan covers
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
from edge.errors import WarmupError
from edge.httpwire import encode_request, parse_response
from edge.llm import GGUFModel

__all__ = ["LoopbackHTTP", "WarmupStep", "WarmupError", "engine_plan", "plan_for", "run_warmup"]

# Representative English text for the long prefill; repeated and cut to the token budget.
PASSAGE = ("The field unit reported nominal telemetry for the third consecutive hour. Battery "
           "voltage held at 12.6 volts, the enclosure stayed below forty degrees, and the camera "
           "pipeline processed every frame within its budget. Operators should review the log "
           "summary below and confirm that no anomalies require a maintenance visit. ")


@dataclass(frozen=True)
class WarmupStep:
    name: str
    path: str
    body: dict[str, Any]


class LoopbackHTTP:
    """The app served on a private 127.0.0.1 socket for the warm-up, by uvicorn's own HTTP
    protocol: warm-up requests cross the HTTP layer (parsing, h11, chunked SSE framing) exactly
    like client requests. The service's own sockets are not touched: they accept nothing until
    READY."""

    def __init__(self, app: Any) -> None:
        from edge.metrics import warmup_transport

        self.app = warmup_transport(app)  # its requests are marked warm-up, apart from production

    async def __aenter__(self) -> "LoopbackHTTP":
        import functools
        import socket

        import uvicorn
        from uvicorn.server import ServerState

        config = uvicorn.Config(self.app, loop="asyncio", lifespan="off", log_config=None,
                                log_level="warning", access_log=False)
        config.load()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        factory = functools.partial(config.http_protocol_class, config=config,
                                    server_state=ServerState(), app_state={})
        self._server = await asyncio.get_running_loop().create_server(factory, sock=self._sock)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """One request on its own connection: (status, body with chunked framing removed)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(encode_request(method, path, body))
        raw = await reader.read()
        writer.close()
        return parse_response(raw)


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


async def run_warmup(http: LoopbackHTTP, steps: list[WarmupStep]) -> list[dict[str, Any]]:
    """Run each step over loopback HTTP; raise WarmupError on the first one that is not a 200."""
    results = []
    for step in steps:
        t0 = time.perf_counter()
        status, body = await http.request("POST", step.path, step.body)
        seconds = time.perf_counter() - t0
        if status != 200 or b'data: {"error"' in body:
            raise WarmupError(f"warm-up step {step.name!r} ({step.path}) failed with HTTP {status}: "
                              f"{body[:300].decode('utf-8', 'replace')}")
        model = step.body.get("model") or step.path.split("/")[3]
        results.append({"name": step.name, "path": step.path, "model": model,
                        "status": status, "seconds": round(seconds, 4),
                        **_tokens(body, bool(step.body.get("stream")))})
    return results
