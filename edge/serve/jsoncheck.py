"""What a JSON request body may hold beyond being JSON: how deep it nests, lone surrogates, and
how many repetitions a JSON schema asks its grammar for.

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

__all__ = ["MAX_JSON_DEPTH", "MAX_SCHEMA_REPEAT", "check_json_depth", "check_schema_repeats",
           "json_depth_exceeds", "lone_surrogate_path", "refuse_lone_surrogates"]

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


# llama.cpp's JSON-schema converter writes a bounded repetition out in full (`minLength: n` is n
# copies of a character rule; a pattern's `{n}` is n copies of what it follows, nested ones
# multiplied): `minLength: 10**9` is gigabytes of grammar text before anything can refuse it.
MAX_SCHEMA_REPEAT = 10_000
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def pattern_repeats(pattern: str) -> int:
    """The most copies of one atom a regex's bounded quantifiers ask for: `a{3}` 3, `(a{3}b){4}`
    12, `a{3}b{4}` 4 (side by side they add, which this bound does not need)."""
    inner = [1]  # per open group: the most copies anything inside it asks for
    last, i = 1, 0  # `last`: copies the atom just before `i` stands for (a group: its inside)
    while i < len(pattern):
        c, step = pattern[i], 1
        if c == "\\":
            last, step = 1, 2
        elif c == "[":  # a class is one atom: skip to its closing bracket
            j = i + 1 + (pattern[i + 1:i + 2] == "]")
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last, step = 1, j + 1 - i
        elif c == "(":
            inner.append(1)
            last = 1
        elif c == ")":
            last = inner.pop() if len(inner) > 1 else 1
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            hi = m[2] or m[1]
            last = last * (int(hi) if len(hi) <= 9 else 10**9)
            step = m.end() - i
        else:
            last = 1
        inner[-1] = max(inner[-1], last)
        i += step
    return inner[0]


def check_schema_repeats(schema: Any, param: str, path: str = "") -> None:
    """Refuse (400, naming the schema's key) a JSON schema whose grammar would repeat something
    more than MAX_SCHEMA_REPEAT times."""
    if isinstance(schema, list):
        for k, item in enumerate(schema):
            check_schema_repeats(item, param, f"{path}[{k}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{param}{path}.{key}"
        big = (key in _COUNTS and isinstance(value, (int, float)) and not isinstance(value, bool)
               and not value <= MAX_SCHEMA_REPEAT)
        if big or key == "pattern" and isinstance(value, str) and pattern_repeats(value) > MAX_SCHEMA_REPEAT:
            raise RequestError(f"{where}: asks for more than {MAX_SCHEMA_REPEAT} repetitions, which "
                               "is more than a grammar for the model's output is built for", param=param)
        check_schema_repeats(value, param, f"{path}.{key}")
