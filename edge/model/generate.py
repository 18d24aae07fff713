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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.model.candidates import Interrupted
from edge.model.constrained import GrammarSampling

if TYPE_CHECKING:
    from edge.model.grammar import CompiledGrammar
    from edge.model.guard import OutputGuard
    from edge.model.native import Native
    from edge.model.promptcache import Marks, PromptCache

__all__ = ["Decoding", "GenParams", "Hold", "Job", "Piece", "SamplerChain", "TokenLogprob", "generate", "MIN_P",
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
class Hold:
    """How long one request may hold its model (`[server] request_timeout_s`), shared by the jobs
    of its choices: the clock starts when the first of them reaches the model's thread (time
    in the queue does not count) and is read after every token."""

    limit_s: float | None = None
    since: float | None = None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def check(self, job: Job) -> None:
        """Raise the documented 422 `generation_timeout` once the request has held its model
        longer than its limit: the generation ends here, and the model takes the next request."""
        if self.limit_s is None or self.since is None:
            return
        held = time.monotonic() - self.since
        if held <= self.limit_s:
            return
        from edge.errors import RequestError

        per = f", {1000 * held / job.completion_tokens:.0f} ms per token" if job.completion_tokens else ""
        raise RequestError(f"the request held its model for {held:.1f} s, longer than server.request_timeout_s "
                           f"= {self.limit_s:g} s allows ({job.completion_tokens} tokens of this choice{per}): "
                           "it was ended there, and the model serves the next request", status=422,
                           code="generation_timeout")


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
    hold: Hold = field(default_factory=Hold)  # the request's time limit on the model, shared by its choices
    adapters: tuple[Any, ...] = ()  # its LoRA adapters and scales (edge.model.adapters.Selection)


class SamplerChain:
    """A request's sampler chain in llama.cpp: built once from its parameters, freed after the
    request. Without a grammar, one native call per token (llama_sampler_sample); with one, the
    grammar half (edge.model.constrained: the token checked first, greedy's likeliest, the
    guard after the grammar, a pass set aside at one step and continued at the next). The
    chain's order stays logit bias, penalties, grammar, the rest. `lazy=False`: the grammar
    over every candidate for every token (the reference the tests compare with)."""

    def __init__(self, native: Native, p: GenParams, lazy: bool = True) -> None:
        lib = native.lib
        self._lib, self._ctx = lib, native.ctx
        self.chain = self.pre = self.grammar = None
        self._g: GrammarSampling | None = None
        self._argmax: _Argmax | None = None  # greedy without grammar or penalties (sample())
        try:
            if not p.grammar:
                self.chain = self._chain(self._bias(native, p), self._rest(lib, p))
                if p.temperature <= 0 and not (p.presence_penalty or p.frequency_penalty):
                    self._argmax = _Argmax(native, _bias_values(p.logit_bias))
                return
            bias = list(self._bias(native, p))
            self.pre = self._chain(bias) if bias else None
            self.grammar = self._need(_grammar_sampler(native, p.grammar))
            self.chain = self._chain(self._rest(lib, p))
            self._g = GrammarSampling(native, self.pre, self.grammar, self.chain, _bias_values(p.logit_bias),
                                      greedy=p.temperature <= 0,
                                      # greedy without penalties: the first choice straight from the (biased) logits
                                      direct=p.temperature <= 0 and not (p.presence_penalty or p.frequency_penalty),
                                      lazy=lazy, guard=_guard(native, p.grammar))
        except BaseException:
            self.close()
            raise

    @property
    def resampled(self) -> int:
        """Tokens the grammar rejected and that were chosen again (tests, profiles)."""
        return self._g.resampled if self._g is not None else 0

    @property
    def full_passes(self) -> int:
        """Of those, the ones the grammar went over the whole vocabulary for."""
        return self._g.full_passes if self._g is not None else 0

    @property
    def saved(self) -> Any:
        """The logits row the last token came from where a pass set aside copied it; else None."""
        return self._g.saved if self._g is not None else None

    @property
    def pending(self) -> bool:
        """A token's grammar pass set aside at a step's budget (Deferred): no token to decode yet."""
        return self._g is not None and self._g.pending

    def _chain(self, *groups: Iterable[Any]) -> Any:
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        try:
            for group in groups:
                for sampler in group:
                    lib.llama_sampler_chain_add(chain, self._need(sampler))
        except BaseException:
            lib.llama_sampler_free(chain)
            raise
        return chain

    @staticmethod
    def _need(sampler: Any) -> Any:
        if not sampler:
            raise ValueError("llama.cpp returned no sampler (grammar that does not compile?)")
        return sampler

    @staticmethod
    def _bias(native: Native, p: GenParams) -> Iterator[Any]:
        """Logit bias and penalties: what changes the logits before the grammar sees them."""
        lib = native.lib
        if p.logit_bias:
            # OpenAI: -100 "should result in a ban": make it one, whatever the logits' scale
            arr = (lib.llama_logit_bias * len(p.logit_bias))(
                *[lib.llama_logit_bias(t, b) for t, b in _bias_values(p.logit_bias)])
            yield lib.llama_sampler_init_logit_bias(native.n_vocab, len(p.logit_bias), arr)
        if p.presence_penalty or p.frequency_penalty:
            yield lib.llama_sampler_init_penalties(native.n_vocab, PENALTY_LAST_N, 1.0,
                                                   p.frequency_penalty, p.presence_penalty)

    @staticmethod
    def _rest(lib: Any, p: GenParams) -> Iterator[Any]:
        """What picks the token, after the grammar."""
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

    def sample(self, idx: int = -1, check: Callable[[], None] | None = None) -> int | None:
        """The next token from the logits of batch row `idx` (the last decoded one by default),
        which the chain accepts (penalties, grammar); None when the grammar allows no token the
        bias leaves (a grammar whose end can only be an end-of-generation token that
        `logit_bias` bans): the generation stops. `check` is called inside the grammar's passes
        over the candidates (it raises to end the step: a deadline, a cancelled job; the chain
        is left as it was, so a sequence set aside can be sampled again; Deferred: the pass goes
        on at the next call)."""
        if self._argmax is not None:  # what the chain's logit bias and greedy pick, without its array
            return self._argmax.pick(self._lib.llama_get_logits_ith(self._ctx, idx))
        if self._g is None:
            return self._lib.llama_sampler_sample(self.chain, self._ctx, idx)
        return self._g.sample(idx, check)

    def close(self) -> None:
        for name in ("chain", "pre", "grammar"):
            sampler = getattr(self, name)
            if sampler:
                self._lib.llama_sampler_free(sampler)  # a chain frees every sampler in it
                setattr(self, name, None)


class _Argmax:
    """Greedy's token from a row of logits with the logit bias added: what llama.cpp's logit-bias
    and greedy samplers give (the first of equal logits, in vocabulary order), without filling
    the chain's array of every candidate (262,144 on Gemma 3: ~0.4 ms a token, against ~0.03)."""

    def __init__(self, native: Native, bias: list[tuple[int, float]]) -> None:
        import numpy as np

        self._np, self._n = np, native.n_vocab
        self._ids = np.array([t for t, _ in bias], dtype=np.int64)
        self._values = np.array([b for _, b in bias], dtype=np.float32)
        self._work = np.empty(self._n, dtype=np.float32) if bias else None

    def pick(self, logits_ptr: Any) -> int:
        np = self._np
        row = np.ctypeslib.as_array(logits_ptr, shape=(self._n,))
        if self._work is not None:
            self._work[...] = row
            np.add.at(self._work, self._ids, self._values)  # in order, a token named twice gets both
            row = self._work
        return int(row.argmax())


def _bias_values(bias: tuple[tuple[int, float], ...]) -> list[tuple[int, float]]:
    """logit_bias as the chain's sampler applies it: -100 and below, a ban (-inf)."""
    return [(t, float("-inf") if b <= -100 else b) for t, b in bias]


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


def _guard(native: Native, grammar: CompiledGrammar | str) -> OutputGuard:
    """The guard after the grammar: the model's token table where the compile brought it, JSON
    mode where the grammar writes a JSON schema's values."""
    from edge.model.guard import OutputGuard, TokenTable

    if isinstance(grammar, str):
        return OutputGuard(TokenTable(native), json=False)
    return OutputGuard(grammar.tokens or TokenTable(native), json=grammar.json)


def _logprob_entry(native: Native, tok: int, k: int, idx: int = -1, row: Any = None) -> TokenLogprob:
    """The chosen token's logprob and the k likeliest, from the model's raw logits of batch row
    `idx` (before bias, penalties and grammar: the model's own distribution, as OpenAI reports it),
    or from `row`, their copy where the token's pass was set aside past a decode."""
    import numpy as np

    logits = native.logits(idx) if row is None else row
    m = float(logits.max())
    lp = logits - (m + float(np.log(np.exp(logits - m).sum())))
    best = sorted(np.argpartition(-lp, k)[:k], key=lambda i: -lp[i]) if k else []
    return TokenLogprob(native.piece(tok), float(lp[tok]),
                        [(native.piece(int(i)), float(lp[i])) for i in best])


class Decoding:
    """One sequence's output, token by token: its text (stop strings held back until they cannot
    start there), logprobs, the finish. The same for a sequence decoded alone (generate) and one
    of a batch (edge.model.slots)."""

    def __init__(self, native: Native, job: Job) -> None:
        self.native, self.job = native, job
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.held = ""  # text that may still turn out to be the start of a stop string
        self.hold = max((len(s) for s in job.params.stop), default=0)
        self.lps: list[TokenLogprob] = []
        self.pos = len(job.tokens)  # where the next token goes in the sequence
        self.tokens: list[int] = []  # the tokens generated, in order

    def take(self, tok: int | None, idx: int = -1, row: Any = None) -> tuple[Piece | None, bool]:
        """The token sampled from batch row `idx` (or from `row`, a copy of its logits:
        SamplerChain.saved): (a piece to send or None, whether the sequence ended). Raises the
        request's 422 once it held its model too long (Hold.check)."""
        job, p, native = self.job, self.job.params, self.native
        if tok is None or native.is_eog(tok):
            return Piece(self.held + self.decoder.decode(b"", final=True), "stop", self.lps), True
        job.completion_tokens += 1
        self.tokens.append(tok)
        if p.logprobs is not None:
            self.lps.append(_logprob_entry(native, tok, p.logprobs, idx, row))
        self.held += self.decoder.decode(native.piece(tok))
        if p.stop:
            cut = _find_stop(self.held, p.stop)
            if cut is not None:
                return Piece(self.held[:cut], "stop", self.lps), True
        if job.completion_tokens >= p.max_tokens:
            return Piece(self.held + self.decoder.decode(b"", final=True), "length", self.lps), True
        if job.cancel.is_set():
            return None, True
        job.hold.check(job)
        if len(self.held) > self.hold:
            keep = len(self.held) - self.hold
            piece = Piece(self.held[:keep], None, self.lps)
            self.held, self.lps = self.held[keep:], []
            return piece, False
        return None, False


def generate(native: Native, cache: PromptCache, job: Job, seq: int) -> Iterator[Piece]:
    """Pieces of text for `job` decoded alone in sequence `seq` (one token per llama_decode: the
    reference a batch's sequences are compared with); the last one has the finish reason
    ("stop" or "length"), unless the job is cancelled, which ends the pieces at the next token."""
    job.hold.start()
    chain = SamplerChain(native, job.params)
    try:
        job.cached_tokens = cache.prefill(seq, job.tokens, use_cache=job.cache_prompt, remember=job.remember,
                                          marks=job.marks)
        job.prefilled = True
        out = Decoding(native, job)
        check = step_check(job)
        while True:
            try:
                tok = chain.sample(check=check)
            except Interrupted:  # cancelled inside a grammar pass: the pieces end here
                return
            piece, done = out.take(tok)
            if piece is not None:
                yield piece
            if done:
                return
            native.decode_one(seq, tok, out.pos)
            cache.append(seq, tok)
            out.pos += 1
    except Exception:
        cache.reset(seq)  # a failed decode leaves the sequence's content unknown
        raise
    finally:
        chain.close()


def step_check(job: Job, budget: Callable[[], None] | None = None) -> Callable[[], None]:
    """What a grammar pass calls between its chunks for `job`: a cancelled job (client gone, drain)
    raises Interrupted, a request past its time limit the 422 (Hold.check): a sampling step ends
    within one chunk, never holding the model (or, batched, the others' step). `budget`, in a
    batch: the step's grammar budget (edge.model.constrained.StepBudget), which raises Deferred
    to set the pass aside until the next step."""
    def check() -> None:
        if job.cancel.is_set():
            raise Interrupted
        job.hold.check(job)
        if budget is not None:
            budget()
    return check


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
