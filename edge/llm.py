"""The llama.cpp model: load (mmap + mlock, measured), tokenize, chat template, generate.

Every method of a loaded model runs on its worker thread (edge.worker.ModelWorker).
"""

from __future__ import annotations

import codecs
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edge.config import ModelConfig
from edge.errors import BackendError, ModelError, RequestError, require
from edge.gguf import GGUFInfo
from edge.mlock import MlockStatus, mlock_status, vm_locked_bytes

__all__ = ["GenParams", "GGUFModel", "Job", "Piece", "diagnose_load_failure", "load_gguf_model"]

log = logging.getLogger("edge")


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
    grammar: str | None = None  # GBNF, already checked with check_grammar
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


@dataclass
class Job:
    tokens: list[int]
    params: GenParams
    cancel: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    prefilled: bool = False  # set by the worker as generation starts: its prompt reached the model


class _Probe:
    """First stage of llama.cpp's sampler chain (a llama-cpp-python logits processor): it sees the
    model's raw logits in token-id order, so logprobs are the model's own distribution (before
    penalties, bias and grammar), and logit_bias is applied before anything else samples."""

    def __init__(self, bias: tuple[tuple[int, float], ...], top: int | None) -> None:
        import numpy as np

        self._np = np
        # OpenAI: -100 "should result in a ban" -- make it one, whatever the logits' scale.
        self.bias = [(t, -np.inf if b <= -100 else b) for t, b in bias]
        self.top = top
        self.logprobs: Any = None

    def __call__(self, input_ids: Any, logits: Any) -> Any:
        if self.top is not None:
            np = self._np
            m = float(logits.max())
            self.logprobs = logits - (m + float(np.log(np.exp(logits - m).sum())))
        for tok, b in self.bias:
            logits[tok] += b
        return logits

    def entry(self, tok: int, piece: Any) -> TokenLogprob:
        np, lp, k = self._np, self.logprobs, self.top or 0
        best = np.argpartition(-lp, k)[:k] if k else []
        best = sorted(best, key=lambda i: -lp[i])
        return TokenLogprob(piece(tok), float(lp[tok]), [(piece(int(i)), float(lp[i])) for i in best])


class GGUFModel:
    """A llama-cpp model; every method must run on the model's worker thread."""

    def __init__(self, cfg: ModelConfig, info: GGUFInfo, llama: Any, mlock: MlockStatus) -> None:
        self.cfg = cfg
        self.info = info
        self.llama = llama
        self.mlock = mlock
        # llama.cpp may round the context up (to 256), but llama-cpp-python sizes its token
        # buffers by the n_ctx asked for: the smaller one is the real limit.
        self.n_ctx = min(int(cfg.n_ctx), int(llama.n_ctx()))
        self._formatter = self._make_formatter()

    def _make_formatter(self) -> Any:
        template = self.cfg.chat_template or self.info.chat_template
        if not template:
            return None
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        vocab = self.llama
        eos = vocab.detokenize([vocab.token_eos()], special=True).decode("utf-8", "replace")
        bos = vocab.detokenize([vocab.token_bos()], special=True).decode("utf-8", "replace")
        try:
            return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            where = "models[].chat_template" if self.cfg.chat_template else "the GGUF's tokenizer.chat_template"
            raise ModelError(self.info.path, f"chat template ({where}) does not compile: {exc}") from None

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.llama.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (it names the variable)."""
        template = self.cfg.chat_template or self.info.chat_template or ""
        return "tools" in template

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = None) -> tuple[list[int], tuple[str, ...]]:
        if self._formatter is None:
            raise RequestError(f"model {self.cfg.name!r} has no chat template: set "
                               "models[].chat_template in the config, or use /v1/completions",
                               param="messages")
        try:
            out = self._formatter(messages=messages, tools=tools, tool_choice=tool_choice)
        except Exception as exc:  # jinja2 errors from the model's own template
            raise RequestError(f"chat template rejected the messages: {exc}", param="messages") from None
        stop = out.stop if isinstance(out.stop, list) else [out.stop] if out.stop else []
        tokens = self.llama.tokenize(out.prompt.encode("utf-8"), add_bos=not out.added_special,
                                     special=True)
        return tokens, tuple(s for s in stop if s)

    @property
    def n_vocab(self) -> int:
        return int(self.llama.n_vocab())

    def token_bytes(self, tok: int) -> bytes:
        return bytes(self.llama.detokenize([tok], special=False))

    def check_grammar(self, gbnf: str, param: str) -> None:
        """Compile a grammar the way generation will: llama.cpp answers NULL for one it cannot
        parse, and a NULL sampler in the chain would crash the worker."""
        import llama_cpp

        sampler = llama_cpp.llama_sampler_init_grammar(self.llama._model.vocab, gbnf.encode("utf-8"),
                                                       b"root")
        if not sampler:
            raise RequestError(f"{param}: llama.cpp cannot compile the grammar made from it", param=param)
        llama_cpp.llama_sampler_free(sampler)

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.n_ctx:
            raise RequestError(f"prompt is {n_prompt} tokens and max_tokens is {max_tokens}: "
                               f"together more than the context of {self.n_ctx} tokens",
                               param="max_tokens" if n_prompt < self.n_ctx else "prompt",
                               code="context_length_exceeded")

    def generate(self, job: Job) -> Iterator[Piece]:
        import llama_cpp

        p = job.params
        # no seed: a fresh random one (llama.cpp's default seed means "random") per request
        self.llama.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if p.seed is None else p.seed)
        probe = _Probe(p.logit_bias, p.logprobs) if p.logit_bias or p.logprobs is not None else None
        grammar = llama_cpp.LlamaGrammar.from_string(p.grammar) if p.grammar else None
        try:
            tokens = self.llama.generate(
                job.tokens, top_k=p.top_k, top_p=p.top_p, temp=p.temperature, reset=True,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                logits_processor=[probe] if probe else None, grammar=grammar)
            yield from self._pieces(job, tokens, probe)
        except RequestError:
            raise
        except Exception as exc:  # llama.cpp decode failures surface as RuntimeError
            raise BackendError(f"llama.cpp failed while generating: {exc}") from exc

    def _pieces(self, job: Job, tokens: Iterator[int], probe: _Probe | None) -> Iterator[Piece]:
        p = job.params
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        held = ""  # text that may still turn out to be the start of a stop string
        hold = max((len(s) for s in p.stop), default=0)
        lps: list[TokenLogprob] = []
        for tok in tokens:
            if self._is_eog(tok):
                yield Piece(held, "stop", lps)
                return
            job.completion_tokens += 1
            if probe is not None and p.logprobs is not None:
                lps.append(probe.entry(tok, self.token_bytes))
            held += decoder.decode(self.token_bytes(tok))
            cut = _find_stop(held, p.stop)
            if cut is not None:
                yield Piece(held[:cut], "stop", lps)
                return
            if job.completion_tokens >= p.max_tokens:
                yield Piece(held + decoder.decode(b"", final=True), "length", lps)
                return
            if job.cancel.is_set():
                return
            if len(held) > hold:
                keep = len(held) - hold if hold else len(held)
                yield Piece(held[:keep], None, lps)
                held, lps = held[keep:], []

    def _is_eog(self, tok: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, tok))


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def load_gguf_model(cfg: ModelConfig, info: GGUFInfo) -> GGUFModel:
    """Load through llama-cpp with mmap/mlock and measure whether the lock really took."""
    llama_cpp = require("llama_cpp", None, "loading GGUF models", package="llama-cpp-python")
    from edge.llama_gpu import require_gpu_offload

    require_gpu_offload(llama_cpp, cfg.name, cfg.n_gpu_layers)  # a CPU-only build would ignore it
    trained = info.context_length
    if trained and cfg.n_ctx > trained:
        log.warning("%s: n_ctx = %d is more than the %d tokens %s was trained for (%s.context_length): "
                    "output past %d tokens is unreliable", cfg.name, cfg.n_ctx, trained, info.path,
                    info.architecture, trained)
    before = vm_locked_bytes()
    try:
        llama = llama_cpp.Llama(
            model_path=info.path, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
            n_threads=cfg.n_threads or os.cpu_count() or 1, n_gpu_layers=cfg.n_gpu_layers,
            use_mmap=cfg.use_mmap, use_mlock=cfg.use_mlock, verbose=False,
        )
    except (ValueError, RuntimeError) as exc:
        why = diagnose_load_failure(info, llama_cpp)
        raise ModelError(info.path, f"llama.cpp could not load the model: {exc}"
                         + (f"; {why}" if why else "")) from None
    status = mlock_status(cfg.use_mlock, vm_locked_bytes() - before, info, use_mmap=cfg.use_mmap,
                          n_gpu_layers=cfg.n_gpu_layers)
    return GGUFModel(cfg, info, llama, status)


def diagnose_load_failure(info: GGUFInfo, llama_cpp: Any) -> str:
    """edge's own reading of why llama.cpp refused a file the GGUF validator passed (llama.cpp
    only says "Failed to load model"): an architecture this llama.cpp was not built with (its
    names are NUL-terminated strings in libllama), or hyperparameters the architecture needs."""
    arch = info.architecture
    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    try:
        with open(str(getattr(lib, "_name", "")), "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            known = m.find(b"\0" + arch.encode() + b"\0") >= 0
    except (OSError, ValueError):
        return ""
    if not known:
        return (f"its architecture {arch!r} (general.architecture) is not one this llama.cpp knows "
                "(llama-cpp-python too old, or not a llama.cpp model)")
    missing = [f"{arch}.{k}" for k in ("context_length", "embedding_length", "block_count")
               if f"{arch}.{k}" not in info.metadata]
    return f"the GGUF lacks {', '.join(missing)}, which {arch!r} models need" if missing else ""
