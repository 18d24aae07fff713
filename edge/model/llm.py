"""The llama.cpp model: load (mmap + mlock, measured), tokenize, chat template, generate.

Every method of a loaded model runs on its worker thread (edge.serve.worker.ModelWorker). The native
calls are edge.model.native's, the generation loop edge.model.generate's, the KV cache edge.model.promptcache's.
"""

from __future__ import annotations

import dataclasses

import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

from edge.config import Config, EmbeddingsConfig, ModelConfig
from edge.errors import BackendError, ModelError, RequestError, require
from edge.model.adapters import Adapter, AdapterPool, describe
from edge.model.embed import EmbedContext, check_embeddings
from edge.model.generate import GenParams, Job, Piece, generate
from edge.model.gguf import GGUFInfo
from edge.model.grammar import CompiledGrammar, compile_grammar
from edge.model.guard import TokenTable
from edge.model.native import ContextSettings, DecodeError, Native
from edge.model.mlock import MlockStatus, mlock_status, vm_locked_bytes
from edge.model.kvtypes import check_kv_types, flash_attn_forced
from edge.model.memory import ContextPlan, context_plan, kv_bytes, prompt_cache_bytes
from edge.model.promptcache import PromptCache, lcp
from edge.model.scheduler import Scheduler
from edge.model.slots import Slots

__all__ = ["GenParams", "GGUFModel", "Job", "Piece", "check_settings", "diagnose_load_failure", "load_gguf_model",
           "settings_for"]

log = logging.getLogger("edge")

PROBES = ("Q", "R")  # two different next turns: a chat prefix ends where their renderings part


class GGUFModel:
    """A llama.cpp model, its context and its prompt cache. Every method runs on the model's
    worker thread, but `close()`, which runs on any thread once no job is left on it."""

    def __init__(self, cfg: ModelConfig, info: GGUFInfo, native: Native, mlock: MlockStatus,
                 plan: ContextPlan | None = None) -> None:
        self.cfg = cfg
        self.info = info
        self.native = native
        self.mlock = mlock
        self.plan = plan or context_plan(cfg, info)
        self.n_ctx = min(self.plan.n_ctx, native.n_ctx)  # llama.cpp may round the context up
        self.cache = PromptCache(native, prompt_cache_bytes(cfg, kv_bytes(cfg, info, self.plan.n_ctx)))
        self.slots = Slots(native, self.cache, native.n_seq, cfg.speculative)
        self.scheduler = Scheduler(self.slots, cfg.name)  # the one thread that calls into the context
        self.tokens = TokenTable(native)  # what the guard after a grammar knows of each token (filled on need)
        self._formatter = self._make_formatter()
        self.embed: EmbedContext | None = None  # /v1/embeddings' context on the same weights (load_gguf_model)
        self.lora = AdapterPool(native)  # every adapter file loaded on the weights (edge.model.adapters)
        self.adapters: dict[str, Adapter] = {}  # the served set's adapters by name (a reload switches it)

    def _make_formatter(self) -> Any:
        template = self.cfg.chat_template or self.info.chat_template
        if not template:
            return None
        from edge.model.bindings import complete

        complete()  # where a start imported the bindings alone: the package whole, before its submodule
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        n = self.native
        eos = n.piece(n.eos, special=True).decode("utf-8", "replace")
        bos = n.piece(n.bos, special=True).decode("utf-8", "replace")
        try:
            return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            where = "models[].chat_template" if self.cfg.chat_template else "the GGUF's tokenizer.chat_template"
            raise ModelError(self.info.path, f"chat template ({where}) does not compile: {exc}") from None

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.native.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)

    def tokenize_text(self, text: str) -> list[int]:
        """Plain text, no BOS, special-token names taken literally (warm-up candidates)."""
        return self.native.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (it names the variable)."""
        template = self.cfg.chat_template or self.info.chat_template or ""
        return "tools" in template

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    tool_choice: Any = None) -> tuple[str, bool, tuple[str, ...]]:
        """(prompt text, whether the template added BOS itself, the template's stop strings)."""
        if self._formatter is None:
            raise RequestError(f"model {self.cfg.name!r} has no chat template: set "
                               "models[].chat_template in the config, or use /v1/completions",
                               param="messages")
        try:
            out = self._formatter(messages=messages, tools=tools, tool_choice=tool_choice)
        except Exception as exc:  # jinja2 errors from the model's own template
            raise RequestError(f"chat template rejected the messages: {exc}", param="messages") from None
        stop = out.stop if isinstance(out.stop, list) else [out.stop] if out.stop else []
        return out.prompt, bool(out.added_special), tuple(s for s in stop if s)

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = None) -> tuple[list[int], tuple[str, ...]]:
        prompt, added_bos, stops = self.render_chat(messages, tools, tool_choice)
        return self.native.tokenize(prompt.encode("utf-8"), add_bos=not added_bos, special=True), stops

    def turn_prefix(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str, bool]:
        """(text, whether the template added BOS): `messages` rendered up to where the next user
        turn's content would begin, which every longer conversation starting with them shares.
        Two different next turns are rendered; the text ends where their renderings part."""
        (a, added_bos, _), (b, _, _) = (self.render_chat([*messages, {"role": "user", "content": probe}], tools)
                                        for probe in PROBES)
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n], added_bos

    def turn_marks(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   tokens: list[int]) -> list[int]:
        """Where later conversations are likely to part from this one (`tokens`, its rendering):
        where the first user turn after the system message begins, which other conversations
        share, and where the last one begins, after the turns this one will send again. Prompt
        cache checkpoints (edge.model.checkpoints) are taken there; a part the template cannot
        render or llama.cpp cannot tokenize gives no mark (marks never fail a request)."""
        starts = [i for i, msg in enumerate(messages) if i and msg.get("role") == "user"]
        marks = []
        for i in sorted({starts[0], starts[-1]}) if starts else ():
            try:
                text, added_bos = self.turn_prefix(messages[:i], tools)
                head = self.native.tokenize(text.encode("utf-8"), add_bos=not added_bos, special=True)
            except (RequestError, ValueError):
                continue
            marks.append(lcp(head, tokens))
        return marks

    @property
    def n_vocab(self) -> int:
        return self.native.n_vocab

    def token_bytes(self, tok: int) -> bytes:
        return self.native.piece(tok)

    def compile_grammar(self, gbnf: str, param: str, json: bool = False) -> CompiledGrammar:
        """Compile a grammar on the grammar thread (edge.model.grammar), not the worker: a 400
        naming `param` for one llama.cpp refuses. Blocks: call it from a thread pool. `json`: the
        grammar writes JSON values (a schema's), which the guard after it keeps free of repeated
        keys (edge.model.guard)."""
        compiled = compile_grammar(self.native.lib, self.native.vocab, gbnf, param)
        compiled.tokens, compiled.json = self.tokens, json
        return compiled

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.n_ctx:
            raise RequestError(f"prompt is {n_prompt} tokens and max_tokens is {max_tokens}: "
                               f"together more than the context of {self.n_ctx} tokens",
                               param="max_tokens" if n_prompt < self.n_ctx else "prompt",
                               code="context_length_exceeded")

    def generate(self, job: Job) -> Iterator[Piece]:
        """`job` decoded alone on the calling thread, in a free slot (one sequence: the reference
        the slots' batched decoding is compared with). An adapted job's slot is emptied first and
        after (its cells are no one's prefix), its prompt computed whole."""
        try:
            with self.slots.spare([] if job.adapters else job.tokens, len(job.tokens) + job.params.max_tokens) as seq:
                yield from self._alone(job, seq)
        except DecodeError as exc:
            raise BackendError(f"llama.cpp failed while generating: {exc}") from exc

    def _alone(self, job: Job, seq: int) -> Iterator[Piece]:
        if job.adapters:  # no cells of another selection to start from, none left for the next
            self.cache.isolate(seq)
            job.cache_prompt = job.remember = False
        try:
            self.native.use_adapters(job.adapters)
            yield from generate(self.native, self.cache, job, seq)
        finally:
            if job.adapters:
                self.cache.reset(seq)

    def context_info(self) -> dict[str, Any]:
        """The llama.cpp context settings in the start report and `edge status`."""
        s = self.native.settings
        return {"n_batch": self.native.n_batch, "n_ubatch": s.n_ubatch, "n_threads": s.n_threads,
                "n_threads_batch": s.n_threads_batch, "flash_attn": s.flash_attn, "swa_full": s.swa_full,
                "parallel": self.native.n_seq, "n_ctx_why": self.plan.n_ctx_why,
                "parallel_why": self.plan.parallel_why, "type_k": s.type_k, "type_v": s.type_v,
                "use_extra_bufts": s.use_extra_bufts, "prompt_cache_limit_bytes": self.cache.limit_bytes,
                "speculative": dataclasses.asdict(self.cfg.speculative),
                **({"adapters": describe(self.adapters)} if self.adapters else {}),
                **({"embeddings": self.embed.describe()} if self.embed is not None else {})}

    def close(self) -> None:
        """The contexts, the KV cache and the mapping now, not whenever GC gets to them (the
        scheduler's thread ended first, its work done)."""
        self.scheduler.close()
        self.cache.clear()
        if self.embed is not None:  # before the model it was made on
            self.embed.close()
        self.native.close()


def check_settings(m: ModelConfig, info: GGUFInfo, cfg: Config) -> None:
    """ConfigError (exit 78, naming `models[i].field` of `cfg`'s file) for a setting this model's
    GGUF header rules out: KV types llama.cpp would refuse, Matryoshka sizes beyond its vectors."""
    where = f"models[{[c.name for c in cfg.models].index(m.name)}]"
    check_kv_types(m, info, cfg.source, where)
    check_embeddings(m, info, cfg.source, where)


def settings_for(cfg: ModelConfig, plan: ContextPlan) -> ContextSettings:
    threads = cfg.n_threads or os.cpu_count() or 1
    n_ctx = plan.n_ctx
    # a quantized V cache: flash attention on, as llama.cpp makes "auto" (the report says so)
    flash = "on" if flash_attn_forced(cfg) else cfg.flash_attn_mode
    return ContextSettings(n_ctx=n_ctx, n_batch=min(cfg.n_batch, n_ctx),
                           n_ubatch=min(cfg.n_ubatch or 512, cfg.n_batch, n_ctx), n_threads=threads,
                           n_threads_batch=cfg.n_threads_batch or threads, flash_attn=flash,
                           swa_full=cfg.swa_full,
                           n_gpu_layers=cfg.n_gpu_layers, use_mmap=cfg.use_mmap, use_mlock=cfg.use_mlock,
                           use_extra_bufts=cfg.use_extra_bufts, n_seq=plan.parallel,
                           type_k=cfg.type_k, type_v=cfg.type_v)


def load_gguf_model(cfg: ModelConfig, info: GGUFInfo, quiet: bool = False, where: str = "models[0]") -> GGUFModel:
    """Load through llama.cpp with mmap/mlock and measure whether the lock really took (`quiet`:
    at a process's own start, its log into memory meanwhile: edge.model.native.Native); its LoRA
    adapters loaded on it (`where`: the model's field in the config, for their errors)."""
    llama_cpp = require("llama_cpp", None, "loading GGUF models", package="llama-cpp-python")
    from edge.model.gpu import require_gpu_offload

    require_gpu_offload(llama_cpp, cfg.name, cfg.n_gpu_layers)  # a CPU-only build would ignore it
    trained, plan = info.context_length, context_plan(cfg, info)
    if trained and plan.n_ctx > trained:
        log.warning("%s: n_ctx = %d is more than the %d tokens %s was trained for (%s.context_length): "
                    "output past %d tokens is unreliable", cfg.name, plan.n_ctx, trained, info.path,
                    info.architecture, trained)
    before = vm_locked_bytes()
    try:
        native = Native(info.path, settings_for(cfg, plan), quiet=quiet)
    except (ValueError, RuntimeError) as exc:
        why = diagnose_load_failure(info, llama_cpp)
        raise ModelError(info.path, f"llama.cpp could not load the model: {exc}"
                         + (f"; {why}" if why else "")) from None
    status = mlock_status(cfg.use_mlock, vm_locked_bytes() - before, info, use_mmap=cfg.use_mmap,
                          n_gpu_layers=cfg.n_gpu_layers)
    model = GGUFModel(cfg, info, native, status, plan)
    if isinstance(cfg.embeddings, EmbeddingsConfig):
        try:
            model.embed = EmbedContext(native, cfg.embeddings, info)
        except ValueError as exc:
            model.close()
            raise ModelError(info.path, f"{exc} (models[].embeddings)") from None
    try:
        model.adapters = model.lora.load(cfg.adapters, info, where)
    except ModelError:
        model.close()
        raise
    return model


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
