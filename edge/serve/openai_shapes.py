"""The OpenAI wire format, answers: completion and chat objects, stream chunks, logprobs, tool calls.

The shapes are the ones the official `openai` client's types validate (tests check with it).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.model.generate import TokenLogprob
from edge.serve.jsoncheck import json_depth_exceeds

if TYPE_CHECKING:
    from edge.serve.state import ServiceState

__all__ = ["Choice", "Shape", "model_list", "parse_tool_calls"]


@dataclass
class Choice:
    """One choice as it is generated: its text so far, its logprobs, why it ended."""
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    def one(tok: bytes, lp: float) -> dict[str, Any]:
        return {"token": _text(tok), "logprob": lp, "bytes": list(tok)}
    return {"content": [{**one(t.token, t.logprob), "top_logprobs": [one(b, lp) for b, lp in t.top]}
                        for t in lps], "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(_text(t.token))
    return {"tokens": [_text(t.token) for t in lps], "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [_by_text(t.top) for t in lps], "text_offset": offsets}


def _by_text(top: list[tuple[bytes, float]]) -> dict[str, float]:
    """Completions key alternatives by text: of tokens that print alike, the likeliest counts."""
    out: dict[str, float] = {}
    for b, lp in top:
        out.setdefault(_text(b), lp)
    return out


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str, names: list[str]) -> list[dict[str, Any]] | None:
    """Tool calls in a model's output: JSON objects {"name", "arguments"|"parameters"}, bare or in
    <tool_call> tags (the forms tool-capable chat templates teach); None when the text is prose."""
    blobs = _TAGGED.findall(text) or [text.strip()]
    calls = []
    for blob in blobs:
        if json_depth_exceeds(blob):
            return None  # deeper than any call: prose to the client, not a RecursionError
        try:
            obj = json.loads(blob)
        except ValueError:
            return None
        for call in obj if isinstance(obj, list) else [obj]:
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            args = call.get("arguments", call.get("parameters", {}))
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call["name"], "arguments": args if isinstance(args, str)
                                       else json.dumps(args, ensure_ascii=False)}})
    return calls or None


class Shape:
    """One request's answer: how choices become OpenAI JSON, streamed or whole."""

    def __init__(self, chat: bool, model: str, logprobs: bool, prompt_chars: list[int] | None = None) -> None:
        """`prompt_chars`: each choice's prompt length; a completion's `text_offset` counts from
        the prompt's start, as OpenAI's (and llama-cpp-python's) do."""
        self.chat, self.model, self.logprobs = chat, model, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self._offsets = dict(enumerate(prompt_chars or []))  # completions: where each choice's next token starts

    def _lp(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps)
        out = completion_logprobs(lps, self._offsets.get(index, 0))
        if out["tokens"]:
            self._offsets[index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def _message(self, c: Choice, delta: bool) -> dict[str, Any]:
        msg: dict[str, Any] = {} if delta else {"role": "assistant"}  # a stream: role_chunk says it once
        if c.tool_calls:
            msg["tool_calls"] = [{**call, "index": i} if delta else call
                                 for i, call in enumerate(c.tool_calls)]
            msg["content"] = None
        elif c.text or not delta:
            msg["content"] = c.text
        return msg

    def _choice(self, c: Choice, delta: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": c.index, "logprobs": self._lp(c.index, c.logprobs),
                               "finish_reason": c.finish}
        if self.chat:
            out["delta" if delta else "message"] = self._message(c, delta)
        else:
            out["text"] = c.text
        return out

    def whole(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(c, False) for c in choices], "usage": usage}

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        data: dict[str, Any] = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            data["usage"] = usage
        return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    def chunk(self, c: Choice) -> bytes:
        return self._event([self._choice(c, True)])

    def role_chunk(self, index: int) -> bytes:
        """The role-only first delta chat clients expect, one per choice."""
        return self._event([{"index": index, "delta": {"role": "assistant"},
                             "logprobs": None, "finish_reason": None}])

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        """stream_options.include_usage: a last chunk with no choices and the request's usage."""
        return self._event([], usage)


def model_list(state: ServiceState) -> list[dict[str, Any]]:
    """/v1/models: each model, then each of its adapters as `model:adapter` (what a request names)."""
    data = []
    for n, w in state.workers.items():
        m = w.model
        data.append({"id": n, "object": "model", "created": state.created, "owned_by": "edge",
                     "context_length": m.n_ctx, "meta": {"n_ctx": m.n_ctx, "tools": m.supports_tools,
                                                         **m.info.summary(),
                                                         **({"embeddings": m.embed.describe()} if m.embed else {}),
                                                         **_adapters_meta(state.adapters_of(w))}})
        data += [{"id": f"{n}:{a.name}", "object": "model", "created": state.created, "owned_by": "edge",
                  "parent": n, "context_length": m.n_ctx, "meta": {"adapter": a.name, "id": i, "scale": a.scale}}
                 for i, a in enumerate(state.adapters_of(w).values())]
    return data


def _adapters_meta(adapters: dict[str, Any]) -> dict[str, Any]:
    """A model's LoRA adapters as /v1/models lists them: the `id` a request's `lora` may give."""
    if not adapters:
        return {}
    return {"adapters": [{"id": i, "name": a.name, "scale": a.scale, "alpha": a.alpha, "bytes": a.nbytes}
                         for i, a in enumerate(adapters.values())]}
