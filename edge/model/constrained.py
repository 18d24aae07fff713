"""A token chosen under a grammar (edge.model.generate.SamplerChain's grammar half): llama.cpp's
own common sampler's way (common/sampling.cpp), greedy's likeliest candidates first, the guard
after the grammar, and a pass that can be set aside at one step and go on at the next.

- **Check one token first.** The token is chosen without the grammar (logit bias, penalties and
  the rest of the chain as always); the grammar is asked about that one token alone. Only a token
  it rejects makes the grammar go over the candidates (262k on Gemma 3, most of a token's
  sampling time), and the token is chosen again from what it allows.
- **Greedy: the likeliest first** (edge.model.candidates): 64, then 1,024, then 16,384 of them,
  and the whole vocabulary only where none decides.
- **The guard** (edge.model.guard): a token the grammar allows but the guard does not (invalid
  UTF-8, a control token, a key its object has) is banned for this token and the choice made
  again: among greedy's likeliest, the next allowed one; after a full pass, the chain again on
  the grammar's verdicts less the banned tokens (after RETRIES, every allowed token is asked).
- **Set aside** (`Deferred`): `check` raises it between chunks of a pass when the step's grammar
  budget is spent (edge.model.generate.StepBudget). The model's logits row is copied then (the
  next decode overwrites it), the pass's place is kept, and the next `sample` goes on from there:
  a slow grammar costs its own sequence steps, not the others' time.

The chain's order stays logit bias, penalties, grammar, the rest: greedy gives the tokens of the
grammar applied to every candidate (tested); with temperature the draw is llama.cpp's (truncation
first, then the grammar), as in llama-server. `lazy=False`: the grammar over every candidate for
every token (the reference the tests compare with).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.model.candidates import Candidates

if TYPE_CHECKING:
    from edge.model.guard import OutputGuard
    from edge.model.native import Native

__all__ = ["GRAMMAR_MIN_S", "GRAMMAR_SHARE", "Deferred", "GrammarSampling", "RETRIES", "StepBudget"]

RETRIES = 8  # choices the guard turns down after a full pass before every allowed token is asked


class Deferred(Exception):
    """The step's grammar budget ran out inside a pass: the sequence samples again at the next step."""


@dataclass
class _Pick:
    """One token being chosen under the grammar, maybe over several steps."""

    idx: int  # the batch row whose logits it reads
    greedy_from: int | None = None  # greedy's next try (an index into Candidates.tops); None: the full pass
    banned: list[int] = field(default_factory=list)  # tokens the guard turned down
    saved: Any = None  # the logits row, copied when set aside past a decode
    filled: bool = False  # the full pass has filled its array (and goes over it)


class GrammarSampling:
    """The grammar half of one request's sampler chain; the samplers are the chain's (it frees
    them): `pre` (logit bias, penalties; or None), `grammar`, `rest` (what picks the token)."""

    def __init__(self, native: Native, pre: Any, grammar: Any, rest: Any, bias: list[tuple[int, float]],
                 greedy: bool, direct: bool, lazy: bool, guard: OutputGuard | None) -> None:
        self._lib, self._ctx, self.lazy = native.lib, native.ctx, lazy
        self.pre, self.grammar, self.rest, self.guard = pre, grammar, rest, guard
        self._cur = Candidates(native, bias)
        self._greedy, self._direct = greedy, direct  # direct: greedy's first choice from the logits
        self._pick: _Pick | None = None
        self._last_saved: Any = None
        self.resampled = 0  # tokens chosen again under the grammar (tests, profiles)
        self.full_passes = 0  # of those, the ones the grammar went over the whole vocabulary for
        self.guarded = 0  # tokens the guard turned down
        self.set_aside = 0  # times a pass was set aside at a step's budget

    @property
    def pending(self) -> bool:
        """A token's pass set aside (Deferred): sample again before the sequence decodes."""
        return self._pick is not None

    @property
    def saved(self) -> Any:
        """The logits row the last token was chosen from where it was copied (set aside past a
        decode: its logprobs are read from it); None: the model's own row."""
        return self._last_saved

    def sample(self, idx: int, check: Callable[[], None] | None) -> int | None:
        """The next token from the logits of batch row `idx`, or None where the grammar (and
        the guard) allow no token the bias leaves. Deferred: set aside, call again (with any
        idx) at the next step; any other exception from `check` leaves the chain as it was."""
        if self._pick is None:
            self._pick = _Pick(idx)
            tok = self._first()
            if tok is not None:
                return self._take(tok)
        try:
            tok = self._rest_of_pick(check)
        except Deferred:
            self.set_aside += 1
            pick = self._pick
            if pick.saved is None:  # the row is still this step's: kept for the next step
                pick.saved = self._cur.copy_row(self._logits_ptr())
            raise
        except BaseException:
            self._pick = None
            raise
        return self._take(tok)

    def _logits_ptr(self) -> Any:
        pick = self._pick
        return pick.saved if pick.saved is not None else self._lib.llama_get_logits_ith(self._ctx, pick.idx)

    def _allowed(self, tok: int) -> bool:
        if not self._cur.allows(self.grammar, tok):
            return False
        if self.guard is not None and not self.guard.allows(tok):
            self.guarded += 1
            self._pick.banned.append(tok)  # type: ignore[union-attr]
            return False
        return True

    def _first(self) -> int | None:
        """The token chosen without the grammar, where the grammar and the guard take it; else
        None, the pick set up for what comes next."""
        cur, pick = self._cur, self._pick
        tok = None
        if self.lazy and self._direct:  # the (biased) logits' argmax: no array to fill
            tok = int(cur.biased(self._logits_ptr()).argmax())  # the first of equal logits, as llama.cpp's greedy
        elif self.lazy:  # (lazy=False: neither; the grammar over every candidate at once, the reference)
            self._apply_chain_only()
            tok = cur.selected()
        if tok is not None and self._allowed(tok):
            return tok
        self.resampled += 1
        greedy_from_logits = self.lazy and (self._direct or cur.filled() is not None and self._greedy)
        pick.greedy_from = 0 if greedy_from_logits else None  # type: ignore[union-attr]
        return None

    def _greedy_logits(self) -> Any:
        return self._cur.biased(self._logits_ptr()) if self._direct else self._cur.filled()

    def _rest_of_pick(self, check: Callable[[], None] | None) -> int | None:
        pick, cur = self._pick, self._cur
        assert pick is not None
        veto = self._veto if self.guard is not None else None
        while pick.greedy_from is not None and pick.greedy_from < len(cur.tops):
            if check is not None:
                check()
            logits = self._greedy_logits()
            if logits is None:
                break
            k = cur.tops[pick.greedy_from]
            tok = cur.greedy_among(self.grammar, self._without_banned(logits), k, veto)
            if tok is not None:
                return tok
            pick.greedy_from += 1
        pick.greedy_from = None
        return self._full_pass(check)

    def _without_banned(self, logits: Any) -> Any:
        if not self._pick.banned:  # type: ignore[union-attr]
            return logits
        out = logits.copy()
        out[self._pick.banned] = float("-inf")  # type: ignore[union-attr]
        return out

    def _veto(self, ids: Any) -> Any:
        return self.guard.veto(ids)  # type: ignore[union-attr]

    def _full_pass(self, check: Callable[[], None] | None) -> int | None:
        """Every candidate through logit bias and penalties, the grammar (in chunks, `check`
        between them: where it raises, the next call goes on from there), the banned tokens
        out, then the rest of the chain; a token the guard turns down is banned and the chain
        goes again over the same verdicts."""
        pick, cur, lib = self._pick, self._cur, self._lib
        assert pick is not None
        if not pick.filled:
            self.full_passes += 1
            ref = cur.fill(self._logits_ptr())
            if self.pre is not None:
                lib.llama_sampler_apply(self.pre, ref)
            pick.filled = True
        cur.apply_grammar(self.grammar, check)
        if pick.banned:
            cur.ban(pick.banned)
        verdicts = cur.snapshot() if self.guard is not None else None
        for attempt in range(RETRIES + 2):
            if attempt == RETRIES:  # the guard's no to many in a row: every allowed token asked at once
                ids = cur.allowed_ids()
                cur.ban(ids[self._veto(ids)])
            lib.llama_sampler_apply(self.rest, cur.ref)
            tok = cur.selected()
            if tok is None or self.guard is None or self.guard.allows(tok):
                return tok
            self.guarded += 1
            pick.banned.append(tok)
            cur.fill(verdicts)
            cur.ban(pick.banned)
            verdicts = cur.snapshot()
        return None

    def _apply_chain_only(self) -> None:
        """Every candidate through logit bias and penalties and the rest of the chain, without
        the grammar (the first choice with a temperature)."""
        ref = self._cur.fill(self._logits_ptr())
        if self.pre is not None:
            self._lib.llama_sampler_apply(self.pre, ref)
        self._lib.llama_sampler_apply(self.rest, ref)

    def _take(self, tok: int | None) -> int | None:
        """The chosen token accepted by every sampler that keeps state (and the guard)."""
        lib = self._lib
        if tok is not None:
            if self.pre is not None:
                lib.llama_sampler_accept(self.pre, tok)
            lib.llama_sampler_accept(self.grammar, tok)
            lib.llama_sampler_accept(self.rest, tok)
            if self.guard is not None:
                self.guard.accept(tok)
        self._last_saved = self._pick.saved if self._pick is not None else None
        self._pick = None
        return tok


GRAMMAR_SHARE = 0.25  # of a step's decode time: what its grammar passes may add while others wait
GRAMMAR_MIN_S = 0.005  # ...and at least this (a tiny model's decode takes a millisecond)


class StepBudget:
    """What one batched step's grammar passes may take while other sequences wait for the next
    decode: GRAMMAR_SHARE of the step's decode time, at least GRAMMAR_MIN_S, counted from the
    first pass's first chunk. Called between chunks (edge.model.generate.step_check): once the
    budget is spent, a pass raises Deferred and goes on after the next decode, first of the
    passes then (edge.model.slots). So a plain sequence's step lasts at most its decode, the
    plain sampling, each grammar sequence's one-token check, the budget and one chunk, however
    slow the grammars beside it; a sequence alone is never set aside."""

    def __init__(self, decode_s: float, others: Callable[[], bool]) -> None:
        self.limit_s = max(GRAMMAR_MIN_S, GRAMMAR_SHARE * decode_s)
        self.others = others  # whether another sequence waits for this step to end
        self.t0: float | None = None

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        elif now - self.t0 > self.limit_s and self.others():
            raise Deferred
