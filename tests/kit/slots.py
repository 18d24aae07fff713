"""Driving a loaded model's slots (edge.model.slots) without a server: a tiny model loaded with its
slots, a sequence's consumer that keeps its text and how it ended, and the time (in steps) of its
first piece; prompts of random words (prefixes that take turns)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from edge.config import ModelConfig
from edge.model.generate import Piece
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model

WORDS = ("apple river stone cloud forest garden window bridge candle market silver orange basket "
         "mirror pencil rabbit engine harbor island ladder").split()


def words(seed: int, n: int) -> str:
    """n words of WORDS drawn from `seed`: a prompt no warm-up has seen, the same every run."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def load_slots(path: Path, n_ctx: int, **fields: object) -> GGUFModel:
    """A model of one thread without mlock, 4 slots unless `fields` say otherwise."""
    cfg = ModelConfig(**{"name": "tiny", "path": str(path), "n_ctx": n_ctx, "n_threads": 1,  # type: ignore[arg-type]
                         "use_mlock": False, "parallel": 4, **fields})
    return load_gguf_model(cfg, read_gguf_info(path))


class Collect:
    """A sequence's consumer (edge.model.sequence.Sink): its text, finish and end; `slots`, if
    given, stamps the step its first piece came at (a wait measured in steps, not seconds)."""

    def __init__(self, slots: Any = None) -> None:
        self.text, self.finish, self.pieces = "", None, 0
        self.ended: BaseException | None | str = "open"
        self.slots, self.first_step = slots, -1

    def started(self) -> None:  # the scheduler took it from the queue: nothing to keep
        pass

    def put(self, piece: Piece) -> None:
        if self.first_step < 0 and self.slots is not None:
            self.first_step = self.slots.stats.steps
        self.text += piece.text
        self.finish = piece.finish_reason or self.finish
        self.pieces += 1

    def close(self, error: BaseException | None) -> None:
        self.ended = error


def greedy_gap(m: Any, tokens: list[int], n_prompt: int, banned: tuple[int, ...] = (), adapters: tuple = ()) -> float:
    """How far below the best logit (of those not `banned`) each token from `n_prompt` on was,
    given the tokens before it, at most, on `m` (a loaded model) in one of its free slots: 0 when
    every one was the greedy choice. A sequence decoded among others (in other cells, other
    batches) rounds differently, so a near-tie may go either way there: compare with a
    tolerance. `adapters`: the LoRA selection the tokens are judged under (edge.model.adapters)."""
    native = m.native
    worst = 0.0
    with m.slots.spare(tokens, len(tokens)) as seq:
        m.cache.reset(seq)
        native.use_adapters(adapters)
        for c in range(0, len(tokens) - 1, native.n_batch):
            chunk = tokens[c:c + native.n_batch]
            native.decode_batch(chunk, list(range(c, c + len(chunk))), [seq] * len(chunk), [1] * len(chunk))
            for k in range(len(chunk)):
                if n_prompt <= c + k + 1 < len(tokens):
                    logits = native.logits(k).copy()
                    logits[list(banned)] = float("-inf")
                    worst = max(worst, float(logits.max() - logits[tokens[c + k + 1]]))
        m.cache.reset(seq)
        native.use_adapters(())
    return worst
