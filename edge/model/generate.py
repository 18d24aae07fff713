"""One generation, on llama.cpp's own sampler chain: the loop that turns a prompt into pieces of
text.

Per generated token the loop makes four native calls (sample, end-of-generation check, piece,
decode) and appends to one string; everything a request asks for is set up once, before the
first token: the sampler chain (logit bias, penalties, grammar, top-k, top-p, min-p,
temperature, seeded distribution, or greedy) is built in llama.cpp from the request's
parameters and freed after it. Logprobs read the model's logits only when asked. The prompt
reaches the KV cache through the prompt cache (edge.model.promptcache), which reuses the longest
prefix any earlier request or declared prefix left.

Runs on the model's worker thread (edge.serve.worker), like every call into llama.cpp.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.model.grammar import CompiledGrammar
    from edge.model.native import Native
    from edge.model.promptcache import Marks, PromptCache

__all__ = ["GenParams", "Job", "Piece", "SamplerChain", "TokenLogprob", "generate", "MIN_P",
           "PENALTY_LAST_N"]

MIN_P = 0.05  # llama.cpp's (and llama-server's) default; OpenAI has no min-p field
PENALTY_LAST_N = 64  # the window presence/frequency penalties look at, as llama-cpp-python had it


@dataclass(frozen=True)
class GenParams:
    max_tokens: int
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: CompiledGrammar | str | None = None  # compiled off the worker (edge.model.grammar), cloned per job
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k likeliest


@dataclass
class TokenLogprob:
    token: bytes
    logprob: float
    top: list[tuple[bytes, float]]


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    at: float = 0.0  # the first piece of a generation: perf_counter() when it was made


@dataclass
class Job:
    tokens: list[int]
    params: GenParams
    cancel: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    prefilled: bool = False  # its prompt reached the model (a job cancelled while queued never does)
    cache_prompt: bool = True  # False: prefill the whole prompt from position 0 (bit-exact repeats)
    remember: bool = True  # False (warm-up): leave the prompt cache as it was found
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    marks: Marks = ()  # where later prompts may part from this one (chat turns): prefill checkpoints


class SamplerChain:
    """A request's sampler chain in llama.cpp: built once from its parameters, one native call
    per token, freed after the request."""

    def __init__(self, native: Native, p: GenParams) -> None:
        lib = native.lib
        self._lib, self._ctx = lib, native.ctx
        self.chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        try:
            for sampler in self._samplers(native, p):
                if not sampler:
                    raise ValueError("llama.cpp returned no sampler (grammar that does not compile?)")
                lib.llama_sampler_chain_add(self.chain, sampler)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _samplers(native: Native, p: GenParams) -> Iterator[Any]:
        lib = native.lib
        if p.logit_bias:
            # OpenAI: -100 "should result in a ban": make it one, whatever the logits' scale
            arr = (lib.llama_logit_bias * len(p.logit_bias))(
                *[lib.llama_logit_bias(t, float("-inf") if b <= -100 else b) for t, b in p.logit_bias])
            yield lib.llama_sampler_init_logit_bias(native.n_vocab, len(p.logit_bias), arr)
        if p.presence_penalty or p.frequency_penalty:
            yield lib.llama_sampler_init_penalties(native.n_vocab, PENALTY_LAST_N, 1.0,
                                                   p.frequency_penalty, p.presence_penalty)
        if p.grammar:
            yield _grammar_sampler(native, p.grammar)
        if p.temperature <= 0:
            yield lib.llama_sampler_init_greedy()
            return
        if p.top_k > 0:
            yield lib.llama_sampler_init_top_k(p.top_k)
        yield lib.llama_sampler_init_top_p(p.top_p, 1)
        yield lib.llama_sampler_init_min_p(MIN_P, 1)
        yield lib.llama_sampler_init_temp(p.temperature)
        # no seed: llama.cpp's default seed means "a fresh random one"
        yield lib.llama_sampler_init_dist(lib.LLAMA_DEFAULT_SEED if p.seed is None else p.seed)

    def sample(self) -> int:
        """The next token from the last decoded logits; the chain accepts it (penalties, grammar)."""
        return self._lib.llama_sampler_sample(self.chain, self._ctx, -1)

    def close(self) -> None:
        if self.chain:
            self._lib.llama_sampler_free(self.chain)  # frees every sampler in the chain
            self.chain = None


def _grammar_sampler(native: Native, grammar: CompiledGrammar | str) -> Any:
    """A grammar sampler for one generation: a clone of the request's compiled grammar (it parses
    nothing on this thread's stack); GBNF text is compiled on the grammar thread all the same."""
    if isinstance(grammar, str):
        from edge.model.grammar import compile_grammar

        grammar = compile_grammar(native.lib, native.vocab, grammar, "grammar")
        try:
            return grammar.clone()
        finally:
            grammar.close()
    return grammar.clone()


def _logprob_entry(native: Native, tok: int, k: int) -> TokenLogprob:
    """The chosen token's logprob and the k likeliest, from the model's raw logits (before bias,
    penalties and grammar: the model's own distribution, as OpenAI reports it)."""
    import numpy as np

    logits = native.logits()
    m = float(logits.max())
    lp = logits - (m + float(np.log(np.exp(logits - m).sum())))
    best = sorted(np.argpartition(-lp, k)[:k], key=lambda i: -lp[i]) if k else []
    return TokenLogprob(native.piece(tok), float(lp[tok]),
                        [(native.piece(int(i)), float(lp[i])) for i in best])


def generate(native: Native, cache: PromptCache, job: Job) -> Iterator[Piece]:
    """Pieces of text for `job`; the last one has the finish reason ("stop" or "length"), unless
    the job is cancelled, which ends the pieces at the next token."""
    p = job.params
    chain = SamplerChain(native, p)
    try:
        job.cached_tokens = cache.prefill(job.tokens, use_cache=job.cache_prompt, remember=job.remember,
                                          marks=job.marks)
        job.prefilled = True
        yield from _decode_loop(native, cache, chain, job)
    except Exception:
        cache.reset()  # a failed decode leaves the sequence's content unknown
        raise
    finally:
        chain.close()


def _decode_loop(native: Native, cache: PromptCache, chain: SamplerChain, job: Job) -> Iterator[Piece]:
    p = job.params
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    held = ""  # text that may still turn out to be the start of a stop string
    hold = max((len(s) for s in p.stop), default=0)
    lps: list[TokenLogprob] = []
    pos, cancel, is_eog, piece = len(job.tokens), job.cancel, native.is_eog, native.piece
    while True:
        tok = chain.sample()
        if is_eog(tok):
            yield Piece(held + decoder.decode(b"", final=True), "stop", lps)
            return
        job.completion_tokens += 1
        if p.logprobs is not None:
            lps.append(_logprob_entry(native, tok, p.logprobs))
        held += decoder.decode(piece(tok))
        if p.stop:
            cut = _find_stop(held, p.stop)
            if cut is not None:
                yield Piece(held[:cut], "stop", lps)
                return
        if job.completion_tokens >= p.max_tokens:
            yield Piece(held + decoder.decode(b"", final=True), "length", lps)
            return
        if cancel.is_set():
            return
        if len(held) > hold:
            keep = len(held) - hold
            yield Piece(held[:keep], None, lps)
            held, lps = held[keep:], []
        native.decode_one(tok, pos)
        cache.append(tok)
        pos += 1


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
