"""The OpenAI wire format: what a completions or chat request asks for, checked field by field.

Every field a client may send is honored, refused with a 400 naming it, or listed in IGNORED
with the reason it is accepted and has no effect; a field edge does not know is a 400 too, so
a client never believes it got something it did not. Answer shapes live in `edge.serve.openai_shapes`.
No native imports here (edge's schema -> grammar converter is pure Python, imported lazily).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge.errors import RequestError
from edge.serve.toolcall import call_place, call_schema

__all__ = ["Ask", "Limits", "IGNORED", "REFUSED", "SchemaAsk", "parse"]

# `cache_prompt` is llama-server's extension (same name, same default): false asks for the whole
# prompt to be computed from position 0, for bit-exact repeats (docs/api.md, "Reproducibility").
# `lora` is llama-server's too: [{"id" or "name", "scale"}], checked against the model's adapters
# where the model is known (edge.model.adapters.select).
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens", "logprobs",
           "cache_prompt", "lora"}
_COMPLETION = _COMMON | {"prompt", "echo"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls"}

# Accepted, and on purpose without effect: why, for each (docs/api.md's table says the same).
IGNORED = {
    "user": "logged with the request; edge has no per-user policy to apply",
    "safety_identifier": "logged like `user`",
    "metadata": "only meaningful for stored completions; edge stores nothing",
    "store": "false is what edge does anyway (true is refused)",
    "service_tier": "one tier: `auto` or `default` accepted, others refused",
    "prompt_cache_key": "edge's prompt cache matches every request by its longest cached prefix by itself",
    "modalities": "`[\"text\"]` is what edge produces (anything else is refused)",
}
# Known OpenAI fields edge does not implement: a 400 naming the field, with the reason.
REFUSED = {
    "suffix": "insertion (fill-in-the-middle) is not implemented",
    "best_of": "only best_of = 1: edge does not rank several generations",
    "audio": "edge serves text models only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "no reasoning models are served",
    "verbosity": "not implemented",
    "web_search_options": "edge has no web search",
    "functions": "deprecated by OpenAI: use `tools`",
    "function_call": "deprecated by OpenAI: use `tool_choice`",
}


@dataclass(frozen=True)
class Limits:
    """What the model behind the request can do (read on the event loop: plain numbers)."""
    n_ctx: int
    n_vocab: int
    max_n: int
    tools: bool  # the chat template renders tools


@dataclass(frozen=True)
class SchemaAsk:
    """The JSON schema a request's output is held to, as it was given: converted once, off the
    event loop (edge.serve.schema.schema_grammar, in the app); a refusal is a 400 naming `param`,
    its message the keyword's path as the client wrote it (`place(path)`)."""
    schema: Any
    param: str
    place: Callable[[str], str]


@dataclass
class Ask:
    """One request, checked: everything generation and the answer's shape need."""
    chat: bool
    sampling: dict[str, Any]  # GenParams fields except max_tokens
    max_tokens: int | None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    forced_tool: bool = False  # tool_choice is `required` or names a function: output is a call
    parallel_tool_calls: bool = True
    schema: SchemaAsk | None = None  # the JSON schema the output is held to
    who: dict[str, str] = field(default_factory=dict)  # `user`, `safety_identifier`: logged
    cache_prompt: bool = True  # False: no KV reuse for this request (bit-exact repeats)


def _bad(param: str, message: str) -> RequestError:
    return RequestError(message, param=param)


def _get(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any,
         lo: float | None = None, hi: float | None = None) -> Any:
    val = body.get(name, default)
    if val is None:
        return default
    if isinstance(val, bool) and bool not in types or not isinstance(val, types):
        raise _bad(name, f"{name} must be {' or '.join(t.__name__ for t in types)}, "
                         f"found {json.dumps(val)[:40]}")
    if isinstance(val, float) and not math.isfinite(val):
        raise _bad(name, f"{name} must be a finite number, found {val}")
    if (lo is not None and not val >= lo) or (hi is not None and not val <= hi):
        raise _bad(name, f"{name} must be in [{lo}, {hi}], found {val}")
    return val


def _check_fields(body: dict[str, Any], chat: bool) -> None:
    known = _CHAT if chat else _COMPLETION
    for name, val in body.items():
        if name in known:
            continue
        if val is None and (name in REFUSED or name in IGNORED and (chat or name == "user")):
            continue  # a field edge knows, null: its default, as for every known field
        if name in REFUSED:
            if (name == "best_of" and val == 1) or (name == "suffix" and val == ""):
                continue
            raise _bad(name, f"{name} is not supported: {REFUSED[name]}")
        if name in IGNORED and (chat or name == "user"):
            _check_ignored(name, val)
            continue
        where = "chat completions" if chat else "completions"
        raise _bad(name, f"unknown field {name!r} for {where} (edge refuses what it would ignore)")


def _check_ignored(name: str, val: Any) -> None:
    if name == "store" and val is not False:
        raise _bad(name, "store: edge stores no completions; only false is accepted")
    if name == "service_tier" and val not in ("auto", "default"):
        raise _bad(name, "service_tier: edge has one tier; only 'auto' or 'default' are accepted")
    if name == "modalities" and val != ["text"]:
        raise _bad(name, "modalities: edge produces text only; only [\"text\"] is accepted")
    if name in ("user", "safety_identifier", "prompt_cache_key") and not isinstance(val, str):
        raise _bad(name, f"{name} must be a string")
    if name == "metadata" and not isinstance(val, dict):
        raise _bad(name, "metadata must be an object")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "stop must be a string or a list of up to 4 non-empty strings")
    return tuple(stop)


def _logit_bias(body: dict[str, Any], n_vocab: int) -> tuple[tuple[int, float], ...]:
    bias = _get(body, "logit_bias", (dict,), {})
    out = []
    for key, val in bias.items():
        if not (key.isascii() and key.lstrip("-").isdigit()):  # int() also takes "1_0", " 1", "١"
            raise _bad("logit_bias", f"logit_bias keys must be token ids (decimal digits), found {key!r}")
        if len(key.lstrip("-")) > 12:  # past any vocabulary; and int() refuses past 4,300 digits
            raise _bad("logit_bias", f"logit_bias: token {key[:12]}... ({len(key)} characters) is not in "
                                     f"the vocabulary (0..{n_vocab - 1})")
        tok = int(key)
        if not 0 <= tok < n_vocab:
            raise _bad("logit_bias", f"logit_bias: token {tok} is not in the vocabulary (0..{n_vocab - 1})")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not -100 <= val <= 100:
            raise _bad("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100], found {val!r}")
        out.append((tok, float(val)))
    return tuple(out)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:  # completions: logprobs is the number of alternatives, 0..5 as OpenAI allows
        return _get(body, "logprobs", (int,), None, 0, 5)
    top = _get(body, "top_logprobs", (int,), None, 0, 20)
    if not _get(body, "logprobs", (bool,), False):
        if top is not None:
            raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _sampling(body: dict[str, Any], chat: bool, limits: Limits) -> dict[str, Any]:
    return {
        "temperature": float(_get(body, "temperature", (int, float), 0.8, 0.0, 2.0)),
        "top_p": float(_get(body, "top_p", (int, float), 0.95, 0.0, 1.0)),
        "top_k": _get(body, "top_k", (int,), 40, 0, 1 << 20),
        "stop": _stop(body),
        "seed": _get(body, "seed", (int,), None, 0, 2**32 - 2),  # 2**32-1 means "random" to llama.cpp
        "presence_penalty": float(_get(body, "presence_penalty", (int, float), 0.0, -2.0, 2.0)),
        "frequency_penalty": float(_get(body, "frequency_penalty", (int, float), 0.0, -2.0, 2.0)),
        "logit_bias": _logit_bias(body, limits.n_vocab),
        "logprobs": _logprobs(body, chat),
    }


def _max_tokens(body: dict[str, Any], chat: bool, n_ctx: int) -> int | None:
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI: it supersedes max_tokens
        return _get(body, "max_completion_tokens", (int,), None, 1, n_ctx)
    return _get(body, "max_tokens", (int,), None, 1, n_ctx)


def _prompts(body: dict[str, Any], n_vocab: int) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", "prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists")
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            continue
        if not isinstance(p, list) or not p or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in p):
            raise _bad("prompt", f"prompt[{i}] must be a string or a non-empty list of token ids "
                                 f"in 0..{n_vocab - 1}")
    return prompt


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    if opts and not stream:
        raise _bad("stream_options", "stream_options is only allowed with stream: true")
    for key in opts:
        if key != "include_usage":
            raise _bad(f"stream_options.{key}", f"stream_options.{key} is not supported")
    include = opts.get("include_usage", False)
    if include is not None and not isinstance(include, bool):
        raise _bad("stream_options.include_usage", "stream_options.include_usage must be a boolean, "
                   f"found {json.dumps(include)[:40]}")
    return stream, bool(include)


_ROLES = ("system", "developer", "user", "assistant", "tool")
# What a message may carry: OpenAI's message fields. The first four reach the template; the
# others are what clients send back with an assistant message of an earlier answer (the
# openai client's message objects carry them, mostly null) and mean nothing to generation.
_MESSAGE_KEYS = ("role", "name", "tool_call_id", "tool_calls")
_MESSAGE_ECHOES = ("content", "refusal", "audio", "function_call", "annotations")


def _content(msg: dict[str, Any], where: str) -> str | None:
    """A string, or a list of text parts (joined); other part types are refused by name."""
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _bad(f"{where}.content[{j}].type", f"{where}.content[{j}]: only parts of type "
                       f"'text' are supported, found type {kind!r}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content[{j}].text", f"{where}.content[{j}]: a text part needs a "
                       f"string `text`, found {json.dumps(part.get('text'))[:40]}")
        texts.append(part["text"])
    return "".join(texts)


def _message(i: int, msg: Any, tools_ok: bool) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
        raise _bad(where, f"{where} must be an object with a role in {list(_ROLES)}")
    unknown = [k for k in msg if k not in _MESSAGE_KEYS and k not in _MESSAGE_ECHOES]
    if unknown:
        raise _bad(f"{where}.{unknown[0]}", f"{where}: unknown field {unknown[0]!r} (a message has "
                   f"{', '.join(_MESSAGE_KEYS + _MESSAGE_ECHOES)})")
    out = {k: v for k, v in msg.items() if k in _MESSAGE_KEYS}
    out["content"] = _content(msg, where)
    if out["role"] == "developer":  # OpenAI's newer name for system; templates know `system`
        out["role"] = "system"
    calls = msg.get("tool_calls")
    if (out["role"] == "tool" or calls) and not tools_ok:
        raise _bad(where, f"{where}: this model's chat template has no tool support")
    if calls is not None and (out["role"] != "assistant" or not isinstance(calls, list)):
        raise _bad(f"{where}.tool_calls", "tool_calls must be a list, on an assistant message")
    if out["role"] == "tool" and not isinstance(msg.get("tool_call_id"), str):
        raise _bad(f"{where}.tool_call_id", f"{where}: a tool message needs a string tool_call_id")
    if out["content"] is None:
        if not calls:
            raise _bad(f"{where}.content", f"{where}.content must be a string or a list of text parts")
        out["content"] = ""  # templates print None as "None"
    return out


def _tools(body: dict[str, Any], ask: Ask, limits: Limits) -> None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return
    if not limits.tools:
        raise _bad("tools", "this model's chat template has no tool support (it never mentions "
                            "`tools`): set models[].chat_template to one that does")
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise _bad("tools", "tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise _bad("tool_choice", f"tool_choice must name one of the tools {names}")
        tools = [t for t in tools if t["function"]["name"] == name]
    elif choice not in (None, "auto", "none", "required"):
        raise _bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or a named function")
    ask.tools, ask.tool_choice = tools, choice
    ask.forced_tool = choice == "required" or isinstance(choice, dict)
    ask.parallel_tool_calls = _get(body, "parallel_tool_calls", (bool,), True)
    if ask.forced_tool:
        ask.schema = SchemaAsk(call_schema(tools), "tools",
                               call_place([names.index(t["function"]["name"]) for t in tools]))


def _response_format(body: dict[str, Any], ask: Ask) -> None:
    fmt = _get(body, "response_format", (dict,), {"type": "text"})
    kind = fmt.get("type")
    extra = [k for k in fmt if k not in ("type", "json_schema" if kind == "json_schema" else "type")]
    if extra:
        raise _bad(f"response_format.{extra[0]}", f"response_format.{extra[0]} is not a field of a "
                   f"{kind!r} response format")
    if kind == "json_object":
        ask.schema = SchemaAsk({"type": "object"}, "response_format", lambda path: "response_format" + path)
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format.json_schema", "response_format.json_schema must be an "
                       "object with a `schema` object")
        extra = [k for k in spec if k not in ("name", "description", "schema", "strict")]
        if extra:  # strict or not, the grammar holds the output to the schema
            raise _bad(f"response_format.json_schema.{extra[0]}", f"response_format.json_schema."
                       f"{extra[0]} is unknown (name, description, schema and strict are its fields)")
        param = "response_format.json_schema"
        ask.schema = SchemaAsk(spec.get("schema") or {"type": "object"}, param, lambda path: param + path)
    elif kind != "text":
        raise _bad("response_format.type", "response_format.type must be 'text', 'json_object' "
                   f"or 'json_schema', found {kind!r}")


def _chat_fields(body: dict[str, Any], ask: Ask, limits: Limits) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty list")
    ask.messages = [_message(i, m, limits.tools) for i, m in enumerate(msgs)]
    _response_format(body, ask)
    if ask.schema is not None and body.get("tools"):
        raise _bad("response_format", "response_format with tools is not supported: one grammar "
                                      "constrains the output")
    _get(body, "parallel_tool_calls", (bool,), True)  # checked with or without tools
    _tools(body, ask, limits)
    if ask.tools and ask.sampling["logprobs"] is not None:
        raise _bad("logprobs", "logprobs with tools is not supported")
    if ask.schema is not None and ask.sampling["stop"]:
        held = "a forced tool call" if ask.forced_tool else ask.schema.param.split(".")[0]
        raise _bad("stop", f"stop with {held} is refused: the grammar ends the output where its JSON value "
                   "ends, and a stop string could only cut it inside a string, leaving JSON that does not "
                   "parse (docs/api.md: stop)")


def parse(body: dict[str, Any], chat: bool, limits: Limits) -> Ask:
    """Check every field of one request against what the model can do."""
    _check_fields(body, chat)
    stream, include_usage = _stream(body)
    ask = Ask(chat=chat, sampling=_sampling(body, chat, limits),
              max_tokens=_max_tokens(body, chat, limits.n_ctx),
              n=_get(body, "n", (int,), 1, 1, limits.max_n), stream=stream,
              include_usage=include_usage,
              who={k: body[k] for k in ("user", "safety_identifier") if body.get(k) is not None},
              cache_prompt=_get(body, "cache_prompt", (bool,), True))
    if chat:
        _chat_fields(body, ask, limits)
    else:
        ask.prompts = _prompts(body, limits.n_vocab)
        ask.echo = _get(body, "echo", (bool,), False)
        if ask.echo and ask.sampling["logprobs"] is not None:
            raise _bad("echo", "echo with logprobs needs the prompt's logprobs, which edge does not "
                               "compute (llama.cpp keeps only the last position's logits)")
    return ask
