"""A JSON schema's `enum` (and `const`) as a grammar: the values' JSON texts in a trie.

llama-cpp-python's converter writes an enum as one alternative per value. llama.cpp keeps a
grammar stack per alternative still open and checks the whole vocabulary against each at every
token (an enum of 1,024 strings: 0.62 s a token on Gemma 3, docs/api.md "Grammar bounds"). Here the
values share their common beginnings, so only the characters that can come next are
alternatives: 1,000 numbered values are 10 wide, not 1,000. The converter also writes a value's
JSON text into a GBNF string without escaping its backslashes (`"c\\\\d"` came out as `"c\\d"`,
invalid JSON, and `"a\\"b"` did not compile); each literal here is escaped for GBNF.

The trie renders as GBNF and as a Python regex of the same language, which the tests compare
with the values (tests/serve/test_schemaenum.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["enum_gbnf", "enum_regex", "enum_texts", "gbnf_literal"]

_GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def gbnf_literal(text: str) -> str:
    return '"' + "".join(_GBNF_ESCAPES.get(c, c if c >= " " and c != "\x7f" else f"\\x{ord(c):02X}")
                         for c in text) + '"'


def enum_texts(values: list[Any]) -> list[str]:
    """The JSON text of each value, as the output must spell it (duplicates once)."""
    return list(dict.fromkeys(json.dumps(v) for v in values))


def _trie(texts: list[str]) -> dict:
    root: dict = {}
    for text in texts:
        node = root
        for c in text:
            node = node.setdefault(c, {})
        node[""] = {}  # the end of a value
    return root


def _render(node: dict, lit: Any, group: Any) -> str:
    """Alternatives of `node`: each a run of characters without a branch, then its own node."""
    alts, ends = [], "" in node
    for c in sorted(k for k in node if k):
        run, child = c, node[c]
        while len(child) == 1 and "" not in child:  # no branch, no end: the run goes on
            (c2, child), = child.items()
            run += c2
        rest = _render(child, lit, group) if any(child) else ""
        alts.append(lit(run) + (" " + rest if rest and lit is gbnf_literal else rest))
    return group(alts, ends) if alts else ""


def _gbnf_group(alts: list[str], optional: bool) -> str:
    if len(alts) == 1 and not optional:
        return alts[0]
    return "(" + " | ".join(alts) + ")" + ("?" if optional else "")


def _regex_group(alts: list[str], optional: bool) -> str:
    return "(?:" + "|".join(alts) + ")" + ("?" if optional else "")


def enum_gbnf(values: list[Any]) -> str:
    """GBNF matching exactly the JSON texts of `values`."""
    return _render(_trie(enum_texts(values)), gbnf_literal, _gbnf_group)


def enum_regex(values: list[Any]) -> str:
    return _render(_trie(enum_texts(values)), re.escape, _regex_group)
