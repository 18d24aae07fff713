"""What the scheduler of one llama.cpp context knows about each slot and each request's sequence
(edge.model.slots): a slot's state as an enum, as llama.cpp's server keeps `slot_state`, and the
sequence a request's choice is decoded in, from admission to its end -- through a suspension
when the context's cells ran out (edge.model.admission), with its LoRA adapter selection
(edge.model.turns) from start to end.

A slot is a llama.cpp sequence id: its number is the id every native call on it names
(edge.model.native takes the id explicitly, nothing remembers a current one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from edge.model.turns import SelectionKey, selection_of

if TYPE_CHECKING:
    from edge.model.checkpoints import PrefillCheckpoints
    from edge.model.generate import Decoding, Job, Piece, SamplerChain
    from edge.model.speculate import Drafter

__all__ = ["Sequence", "Sink", "Slot", "SlotState", "SlotStats"]


class SlotState(enum.Enum):
    """Where a slot is. IDLE and CACHED take a new request; the others hold one."""

    IDLE = "idle"  # no request, no cells
    CACHED = "cached"  # no request; its cells hold the last one's tokens (the prompt cache's live sequence)
    WAITING = "waiting"  # a request that waits for another slot's prefill of the same prompt (its cells are copied then)
    PREFILLING = "prefilling"  # its prompt is decoded in chunks
    GENERATING = "generating"  # one token per step

    @property
    def free(self) -> bool:
        return self in (SlotState.IDLE, SlotState.CACHED)


class Sink(Protocol):
    """Where a sequence's pieces go (edge.serve.worker's channel): never blocks."""

    def started(self) -> None: ...  # the scheduler took its job from the queue for a slot

    def put(self, piece: Piece) -> None: ...

    def close(self, error: BaseException | None) -> None: ...


@dataclass(eq=False)
class Slot:
    id: int  # the llama.cpp sequence id
    state: SlotState = SlotState.IDLE
    seq: Sequence | None = None
    used: int = 0  # when it was last given up (the scheduler's step count): least recently used first out


@dataclass(eq=False)
class Sequence:
    """One choice of one request, from admission to its end."""

    job: Job
    sink: Sink
    chain: SamplerChain
    out: Decoding
    order: int  # admission order: the highest is the youngest, the first to give its cells up
    tokens: list[int]  # what its slot must hold before it samples: the prompt, or (resumed) prompt and answer so far
    slot: Slot | None = None
    done: int = 0  # positions of `tokens` its slot holds
    plan: PrefillCheckpoints | None = None
    leader: Sequence | None = None  # the sequence whose prefill of the same prompt it waits for
    followers: list[Sequence] = field(default_factory=list)
    row: int = -1  # the batch row whose logits it samples after this step's decode
    chunk: int = 0  # prompt tokens of it in this step's batch
    tok: int = -1  # the token it decodes next
    stepped: bool = False  # in this step's batch (its adapter selection's turn: edge.model.turns)
    suspensions: int = 0  # times its cells were given up while it ran
    drafter: Drafter | None = None  # its proposals (edge.model.speculate); None: speculation off
    draft: list[int] = field(default_factory=list)  # this step's proposals after `tok`, decoded with it
    draft_rows: list[int] = field(default_factory=list)  # their batch rows

    @property
    def state(self) -> SlotState | None:
        return self.slot.state if self.slot is not None else None

    @property
    def selection(self) -> SelectionKey:
        """Its LoRA adapters and scales (empty: the base model's): whose turn it decodes at."""
        return selection_of(self.job)

    @property
    def generating(self) -> bool:
        return self.state is SlotState.GENERATING

    @property
    def prefilling(self) -> bool:
        return self.state is SlotState.PREFILLING

    def has_work(self, budget: int) -> bool:
        """Whether it puts a token in this step's batch: its next token (a grammar pass set
        aside has none yet), or a chunk of its prompt where the step has cells (`budget`) for one."""
        return (self.generating and not self.chain.pending) or (self.prefilling and budget > 0)


@dataclass
class SlotStats:
    """Counters read by /metrics (plain ints, written on the scheduler thread)."""

    steps: int = 0
    batch_tokens: int = 0  # tokens decoded over all steps
    last_batch: int = 0  # tokens of the last step
    last_sequences: int = 0  # sequences in the last step
    batch_sequences: int = 0  # sequences over all steps
    sequences: int = 0  # sequences started
    shared_prompts: int = 0  # sequences that took another slot's prefill of their prompt
    suspended: int = 0  # sequences whose cells were given up while they ran (edge.model.admission)
    given_way: int = 0  # idle slots' cached sequences that gave their cells up
    retried: int = 0  # steps llama.cpp found no cells for, decoded again after room was made
    decode_s: float = 0.0  # time in llama_decode
    sample_s: float = 0.0  # time sampling and making text, after the decodes
    step_s: float = 0.0  # time in the steps: those two, and building the batch, admission, suspensions
