"""An enum as a trie of its values' JSON texts: the grammar's language (rendered as a regex from
the same trie) is exactly those texts, quotes, backslashes and control characters escaped; it is
as wide as the characters that can come next, not as the values."""

from __future__ import annotations

import json
import random
import re

from edge.serve.schema import measure_gbnf, schema_grammar
from edge.serve.schema.enums import enum_gbnf, enum_regex, enum_texts, gbnf_literal


def test_the_trie_matches_exactly_the_values_json_texts() -> None:
    rng = random.Random(33)
    for _ in range(400):
        values = [*("".join(rng.choice('ab"\\\n\u00e9x') for _ in range(rng.randint(0, 5)))
                    for _ in range(rng.randint(1, 30))),
                  *rng.sample([1, -2, 3.5, None, True, False, [1], {"k": "v"}], rng.randint(0, 3))]
        rx, texts = re.compile(enum_regex(values)), set(enum_texts(values))
        for text in texts:
            assert rx.fullmatch(text), (values, text)
            for near in (text[:-1], text + "a", text[1:], "x" + text, text.replace('"', "", 1)):
                assert bool(rx.fullmatch(near)) == (near in texts), (values, near)


def test_literals_are_escaped_for_gbnf() -> None:
    assert gbnf_literal('a"b\\c\nd\x01') == '"a\\"b\\\\c\\nd\\x01"'
    assert enum_gbnf(["Par", "Paris"]) == '"\\"Par" ("\\"" | "is\\"")'
    assert json.dumps("c\\d") in enum_texts(["c\\d"])


def test_an_enum_of_a_thousand_values_is_ten_wide() -> None:
    gbnf = schema_grammar({"enum": [f"value-{i:06d}" for i in range(1000)]}, "response_format.json_schema")
    assert measure_gbnf(gbnf).widest == 10
