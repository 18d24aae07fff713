"""Chats whose turns alternate, on a loaded model (edge.model.llm.GGUFModel), as the prompt cache
tests drive them: each conversation re-sends its growing history with its own answers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any


def chats_in_turns(m: Any, systems: list[str], user: Callable[[int, int], str], turns: int = 6,
                   max_tokens: int = 8) -> list[int]:
    """Run the chats (one per system message; user(turn, chat) is a user turn's text) and check
    that every turn after the first reuses at least its conversation's previous prompt; the
    last prompts' lengths."""
    from edge.model.generate import GenParams, Job

    chats = [[{"role": "system", "content": system}] for system in systems]
    previous = [0] * len(chats)
    for turn in range(turns):
        for c, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": user(turn, c)})
            prompt, stops = m.tokenize_chat(msgs)
            job = Job(tokens=prompt, params=GenParams(max_tokens=max_tokens, temperature=0, stop=stops),
                      marks=partial(m.turn_marks, msgs, None, prompt))
            answer = "".join(p.text for p in m.generate(job))
            if turn:
                assert job.cached_tokens >= previous[c], (turn, c, job.cached_tokens, previous[c])
            previous[c] = len(prompt)
            msgs.append({"role": "assistant", "content": answer})
    return previous
