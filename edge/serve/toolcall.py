"""A forced tool call (`tool_choice` `required` or a named function) both ways: the JSON schema its
output is held to (`{"name": one of the tools, "arguments": its parameters}`, each tool's `$ref`s
rebased to where its parameters sit), where a keyword of that schema sits in the request (so a
400 names `tools[i].function.parameters.<path>` as the client wrote it), and a call whose JSON
max_tokens cut read back as a call, never as prose."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from edge.errors import RequestError
from edge.serve.schema.merge import rebase

__all__ = ["call_place", "call_schema", "forced_call"]

# where a tool's parameters sit in a forced call's schema (call_schema), in a keyword's path and
# in the pointers of the `$ref`s rebased into it
_IN_ARGUMENTS = re.compile(r"^(?:\.anyOf\[(\d+)\])?\.properties\.arguments(?=$|[.\[])")
_REBASED = re.compile(r"#/(?:anyOf/\d+/)?properties/arguments")


def call_place(indices: list[int]) -> Callable[[str], str]:
    """A keyword's path in a forced call's schema as the client wrote it: inside tool k's
    parameters, `tools[i].function.parameters...` (i: the tool's place in `tools`); elsewhere
    (the call's own wrapper, the grammar's bounds), `tools`."""
    def place(path: str) -> str:
        m = _IN_ARGUMENTS.match(path)
        if m is None:
            return "tools"
        i = indices[int(m[1] or 0)]
        return f"tools[{i}].function.parameters" + _REBASED.sub("#", path[m.end():])
    return place


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON a forced call must be: {"name": one of the tools, "arguments": its parameters}."""
    def one(t: dict[str, Any], at: str) -> dict[str, Any]:
        params = t["function"].get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": rebase(params, f"{at}/properties/arguments")},
                "required": ["name", "arguments"]}
    # a `$ref` of the parameters points into them: rebased to where they sit in the call's schema
    return one(tools[0], "") if len(tools) == 1 else {"anyOf": [one(t, f"/anyOf/{i}") for i, t in enumerate(tools)]}


# how a forced call's grammar starts it (call_schema: `name` first, at most one space around the
# punctuation), and where its arguments begin
_CALL_HEAD = re.compile(r'\{ ?"name" ?: ?"((?:[^"\\]|\\.)*)("?)')
_ARGS_AT = re.compile(r' ?, ?"arguments" ?: ?')


def forced_call(text: str, names: list[str], finish: str | None) -> dict[str, Any]:
    """A forced tool call whose JSON did not finish (max_tokens cut it: `finish`): the tool it
    names, or the only one its name so far can still be, and its arguments' text as far as they
    got, as OpenAI answers a call cut by length. A 422 where the name so far fits several tools."""
    head = _CALL_HEAD.match(text)
    written, closed = (head[1], bool(head[2])) if head else ("", False)
    spelled = {n: json.dumps(n)[1:-1] for n in names}  # as the grammar writes the name's const
    fits = [n for n, t in spelled.items() if (t == written if closed else t.startswith(written))]
    if len(fits) != 1:
        raise RequestError(f"the forced tool call ended ({finish or 'cut'}) before its tool's name was "
                           f"complete ({written!r} fits {fits}): give it more max_tokens", status=422,
                           code="tool_call_incomplete")
    rest = text[head.end():] if head is not None and closed else ""
    args = _ARGS_AT.match(rest)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": fits[0], "arguments": rest[args.end():] if args else ""}}
