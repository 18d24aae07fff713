"""GBNF grammars compiled by llama.cpp where a deep recursion cannot kill the process, once per
request, and handed to generation compiled.

llama.cpp's grammar parser recurses once per nested group (about 450 bytes of stack a level,
measured: 8 MiB, the default thread stack, overflows near 18,700 levels, which is a SIGSEGV of the
whole service), and its left-recursion check once per rule reference (about 130 bytes a level). So
every compile runs on one thread of its own with a COMPILE_STACK_BYTES stack, far more than the
bounds edge.serve.schema puts on a grammar need (1,000 levels, 128 KiB of text: at most
~0.5 MiB + 64k references x 130 bytes ~ 9 MiB). The stack is virtual memory: only the pages a
compile touches become resident.

The compile never runs on the model's worker thread (it reads only the vocabulary, which does not
change after the load), so a long one holds no model; it must end within COMPILE_TIMEOUT_S or the
request is refused (the compile finishes in the background and is freed). Generation clones the
compiled sampler into its chain (`llama_sampler_clone` copies the parsed rules, parsing nothing).

While it compiles, C's `stderr` points into memory (edge.model.nativelog.captured_stderr): a
grammar llama.cpp refuses is printed by its parser whole (hundreds of KiB); edge logs one line
with the reason and the size instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge.errors import RequestError
from edge.model.nativelog import RateLimiter, captured_stderr, summarize_native_output

if TYPE_CHECKING:
    from edge.model.guard import TokenTable

__all__ = ["COMPILE_STACK_BYTES", "COMPILE_TIMEOUT_S", "CompiledGrammar", "compile_grammar"]

log = logging.getLogger("edge")

COMPILE_STACK_BYTES = 64 << 20
COMPILE_TIMEOUT_S = 5.0  # measured: a grammar within edge's bounds compiles in < 0.1 s on 2 cores


class CompiledGrammar:
    """One compiled grammar sampler; `clone()` per generation, freed after the request (or when
    dropped)."""

    def __init__(self, lib: Any, sampler: Any, compile_s: float, size: int) -> None:
        self._lib, self.sampler, self.compile_s, self.size = lib, sampler, compile_s, size
        self.json = False  # its outputs are JSON values (a schema's grammar): the guard keeps keys unique
        self.tokens: TokenTable | None = None  # the model's token classes, for the guard (edge.model.guard)
        self._free = weakref.finalize(self, lib.llama_sampler_free, sampler)

    def clone(self) -> Any:
        """A fresh sampler in the compiled grammar's start state; the caller's chain owns it."""
        if not self._free.alive:
            raise RuntimeError("the compiled grammar was freed")
        return self._lib.llama_sampler_clone(self.sampler)

    def close(self) -> None:
        self._free()


class _Compiler:
    """The one thread grammars compile on, with a big stack."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._thread is None:
                old = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    self._thread = threading.Thread(target=self._loop, name="edge-grammar", daemon=True)
                    self._thread.start()
                finally:
                    threading.stack_size(old)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fut, fn))
        return fut

    def _loop(self) -> None:
        while True:
            fut, fn = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiter
                fut.set_exception(exc)


_COMPILER = _Compiler()
_WARNINGS = RateLimiter()  # what llama.cpp printed while compiling: a few lines a minute, then a count


def _compile(lib: Any, vocab: Any, gbnf: str) -> tuple[Any, float, bytes]:
    with captured_stderr() as out:
        t0 = time.perf_counter()
        sampler = lib.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
        seconds = time.perf_counter() - t0
    return sampler, seconds, out.text


def compile_grammar(lib: Any, vocab: Any, gbnf: str, param: str,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
    """Compile on the grammar thread; a 400 naming `param` for a grammar llama.cpp refuses or one
    that takes longer than `timeout_s`. Blocks the calling thread (use from a thread pool)."""
    fut = _COMPILER.submit(lambda: _compile(lib, vocab, gbnf))
    try:
        sampler, seconds, output = fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        fut.add_done_callback(lambda f: f.exception() is None and f.result()[0] and lib.llama_sampler_free(f.result()[0]))
        raise RequestError(f"{param}: llama.cpp took more than {timeout_s:g} s to compile the grammar "
                           "made from it", param=param) from None
    if output:
        ok, held = _WARNINGS.allow(b"grammar output")
        if held:
            log.warning("llama.cpp printed on %d more grammars in the last minute (not logged)", held)
        if ok:
            log.warning("llama.cpp on the grammar for %s: %s", param, summarize_native_output(output))
    if not sampler:
        reason = summarize_native_output(output, limit=160) if output else "no reason given"
        raise RequestError(f"{param}: llama.cpp cannot compile the grammar made from it ({reason})",
                           param=param)
    return CompiledGrammar(lib, sampler, seconds, len(gbnf))
