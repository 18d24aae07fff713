"""JSON depth measured without parsing, against the depth of what `json.loads` really builds."""

from __future__ import annotations

import json
import random

import pytest

from edge.errors import RequestError
from edge.serve.jsoncheck import MAX_JSON_DEPTH, check_json_depth, json_depth_exceeds

# Strings full of what the scan must not count or must not be fooled by.
_TRICKY = ["[", "]{", '"', '\\', '\\"[', '[\\\\', "\u00e9[", "\ud83d\ude00{", "}]", "\\u005b", ""]


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _value(rng: random.Random, depth: int) -> object:
    """A value about `depth` deep: one child carries the depth on, its siblings stay shallow."""
    if depth <= 0:
        return rng.choice([rng.choice(_TRICKY) * rng.randint(1, 30), 1.5, None, True, "x"])
    children = [_value(rng, depth - 1)] + [_value(rng, min(depth - 1, rng.randint(0, 2)))
                                           for _ in range(rng.randint(0, 2))]
    rng.shuffle(children)
    if rng.random() < 0.5:
        return children
    return {rng.choice(_TRICKY) + str(i): c for i, c in enumerate(children)}


def test_depth_matches_what_the_parser_builds() -> None:
    rng = random.Random(23)
    seen = set()
    for _ in range(300):
        value = _value(rng, rng.randint(1, 150))
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            real = _depth(json.loads(text))
            seen.add(real > MAX_JSON_DEPTH)
            for limit in (real - 1, real, MAX_JSON_DEPTH):
                assert json_depth_exceeds(text, limit) == (real > limit), (limit, real, text[:200])
    assert seen == {True, False}  # both sides of the limit were drawn


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b"[" * 10_000 + b'"\\ud800"' + b"]" * 10_000,
    b"[" * 100_000,  # never closed: a parser recurses all the same before it fails
    ("[" * 100 + "]" * 100).encode("utf-16"),  # json.loads reads UTF-16 bodies too
    json.dumps(["\\\"" + "]" * 50, "[" * 65]).replace('"[', "[").encode(),  # brackets after a quote escape
])
def test_deep_bodies_are_refused_naming_the_limit(body: bytes) -> None:
    with pytest.raises(RequestError) as err:
        check_json_depth(body)
    assert err.value.status == 400 and f"more than {MAX_JSON_DEPTH} levels deep" in str(err.value)


@pytest.mark.parametrize("body", [
    json.dumps({"prompt": "[" * 100_000}).encode(),  # brackets inside a string nest nothing
    json.dumps({"p": ['\\"[' * 1000, "{" * 1000]}).encode(),
    ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH).encode(),
    b"[]" * 100_000,
    b"\xff[[[" * 100,  # not UTF-8: left to the parser, which refuses it before recursing
])
def test_shallow_bodies_pass(body: bytes) -> None:
    check_json_depth(body)
