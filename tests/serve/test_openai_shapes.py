"""Answer shapes without a model: tool-call parsing and logprob formats."""

from __future__ import annotations

import json

from edge.model.generate import TokenLogprob
from edge.serve.openai_shapes import completion_logprobs, parse_tool_calls


def test_tool_calls_are_parsed_bare_tagged_or_not_at_all() -> None:
    bare = parse_tool_calls(' {"name": "weather", "arguments": {"city": "Oslo"}}\n', ["weather"])
    assert bare and bare[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    tagged = parse_tool_calls('<tool_call>{"name": "a", "parameters": {}}</tool_call>\n'
                              '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>', ["a", "b"])
    assert [c["function"]["name"] for c in tagged] == ["a", "b"]
    assert json.loads(tagged[1]["function"]["arguments"]) == {"x": 1}
    assert len({c["id"] for c in tagged}) == 2
    assert parse_tool_calls("It is sunny in Oslo.", ["weather"]) is None
    assert parse_tool_calls('{"name": "other", "arguments": {}}', ["weather"]) is None
    assert parse_tool_calls('{"city": "Oslo"}', ["weather"]) is None


def test_completion_logprobs_offsets_and_alike_alternatives() -> None:
    lps = [TokenLogprob(b"He", -0.1, [(b"He", -0.1), (b"\xff", -2.0), (b"\xfe", -3.0)]),
           TokenLogprob(b"llo", -0.5, [(b"llo", -0.5)])]
    out = completion_logprobs(lps, 5)
    assert out["tokens"] == ["He", "llo"] and out["text_offset"] == [5, 7]
    assert out["top_logprobs"][0] == {"He": -0.1, "\ufffd": -2.0}  # the likelier of the two alike
