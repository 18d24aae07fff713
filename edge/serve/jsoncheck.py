"""What a JSON request body may hold beyond being JSON: how deep it nests, lone surrogates. (What
a JSON schema may ask of its grammar: edge.serve.schema.)

Python's `json` parser recurses once per nested array or object and raises RecursionError near
a thousand levels (the interpreter's recursion limit), so nesting is measured on the text
itself, without recursion and before anything parses it: brackets outside strings, counted.
Only arrays and objects nest; every value edge accepts is far shallower than the limit.
"""

from __future__ import annotations

import json
import operator
import re
from itertools import accumulate, repeat
from typing import Any

from edge.errors import RequestError

__all__ = ["MAX_JSON_DEPTH", "check_json_depth", "json_body", "json_depth_exceeds", "lone_surrogate_path",
           "refuse_lone_surrogates"]

MAX_JSON_DEPTH = 64  # arrays and objects, the outermost counted: {"a": [1]} is 2 levels deep

_ESCAPE = re.compile(r"\\.", re.S)  # one escape inside a string (\" \\ \n \uXXXX's "u")
_KEEP_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # +1 / -1, offset by one to fit a byte
_CHUNK = 1 << 16


def json_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `text` opens more than `limit` arrays/objects at once anywhere, counting brackets
    outside strings. Exact over the part of `text` that is valid JSON (what a parser would walk
    before failing); in C-speed passes, with a Python step only where brackets are many."""
    if text.count("[") + text.count("{") <= limit:
        return False
    if "\\" in text:  # escapes removed, every quote left opens or closes a string
        text = _ESCAPE.sub("", text)
    outside = "".join(text.split('"')[::2]).encode("utf-8", "surrogatepass")
    steps = outside.translate(_STEPS, _KEEP_BRACKETS)
    depth = 0
    for start in range(0, len(steps), _CHUNK):
        chunk = steps[start:start + _CHUNK]
        levels = list(accumulate(map(operator.sub, chunk, repeat(1)), initial=depth))
        if max(levels) > limit:
            return True
        depth = levels[-1]
    return False


def check_json_depth(body: bytes) -> None:
    """Refuse (400) a body nested deeper than MAX_JSON_DEPTH. Decoded as `json.loads` decodes
    bytes (UTF-8, or UTF-16/32 by their byte pattern); a body that does not decode is left to
    the parser, which fails on it before recursing."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except (UnicodeDecodeError, LookupError):
        return
    if json_depth_exceeds(text):
        raise RequestError(f"request body nests JSON arrays/objects more than {MAX_JSON_DEPTH} "
                           f"levels deep; {MAX_JSON_DEPTH} is the limit", code="json_too_deep")


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The JSON path (`messages[0].content`) of the first string holding a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "<body>"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and lone_surrogate_path(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = lone_surrogate_path(item, sub)
        if found is not None:
            return found
    return None


# A JSON \u escape of a UTF-16 surrogate (D800-DFFF), or one's own three bytes in a UTF-8 body
# (ED A0..BF xx: not valid UTF-8, which `json.loads` decodes with "surrogatepass" all the same).
# Only UTF-8 bodies that have one, and every UTF-16/32 body, are walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def refuse_lone_surrogates(body: bytes) -> None:
    """Refuse (400, naming the field) a body with a string holding a lone UTF-16 surrogate.
    The body's depth is checked first (`check_json_depth`): the walk recurses per level too."""
    if json.detect_encoding(body).startswith("utf-8") and not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return  # not JSON: the route says so
    path = lone_surrogate_path(value)
    if path is not None:
        raise RequestError(f"{path}: the string holds a lone UTF-16 surrogate (such as \\ud800), "
                           "which is not valid Unicode text", param=path.split(".")[0].split("[")[0])


async def json_body(request: Any) -> dict[str, Any]:
    """A route's request body (a starlette Request's) as a JSON object, or a 400 saying why not."""
    raw = await request.body()
    check_json_depth(raw)  # before the parser, which recurses once per level
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, found {type(body).__name__}")
    return body
