"""What llama.cpp may write to the journal: its log, capped and rate-limited, and the text it prints
straight to C's `stderr` while it compiles a grammar, captured and summarised.

- `install_log_callback()` routes llama.cpp's (and ggml's) log through `llama_log_set` to the
  `edge.native` logger: errors only (as llama-cpp-python's own callback did), each line cut at
  MAX_LINE_BYTES with its size said, and at most RATE_BURST lines of one kind (the line with its
  numbers taken out) per RATE_WINDOW_S; how many were held back is said once the window is over.
- `captured_stderr()` points C's `stderr` into memory for the block it guards; llama.cpp's grammar
  parser prints a grammar it refuses whole with `fprintf(stderr, ...)` (four requests wrote
  466 KB to the journal). The caller logs `summarize_native_output()` of it: the first line, cut,
  and the size. Python's own `sys.stderr` writes to the file descriptor and is not affected.
- `quiet_load()` is for a process's own start, when nothing else runs llama.cpp yet: llama.cpp's
  default logger (`fputs` to C's `stderr`, captured in memory) while a model loads, so that none
  of the ~1,500 lines of a load takes the GIL through the callback; the error lines among them
  are logged afterwards, through the same limits (a load beside a busy thread: 0.43–0.45 s
  against 0.47–0.48 s through the callback, on the project's 2-core VM).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_LINE_BYTES", "RATE_BURST", "RATE_WINDOW_S", "RateLimiter", "captured_stderr",
           "install_log_callback", "quiet_load", "summarize_native_output"]

_ERROR_LINE = re.compile(rb"\b(error|failed|fail|abort)\b", re.I)  # llama.cpp's default logger says no level

log = logging.getLogger("edge.native")

MAX_LINE_BYTES = 300
RATE_BURST = 5
RATE_WINDOW_S = 60.0
_ERROR, _CONT = 3, 5  # ggml_log_level
_DIGITS = re.compile(rb"\d+")


def summarize_native_output(text: bytes, limit: int = MAX_LINE_BYTES) -> str:
    """The first non-empty line of a native library's output, cut at `limit`, and the size."""
    first = next((line for line in text.splitlines() if line.strip()), b"").decode("utf-8", "replace").strip()
    cut = first if len(first) <= limit else first[:limit] + "..."
    whole = len(first) <= limit and len(text) <= len(first) + 2
    return cut if whole else f"{cut} [{len(text)} bytes of output, the rest left out]"


class RateLimiter:
    """At most `burst` lines of one kind per `window_s`; `allow()` answers whether to log one, and
    how many of its kind were held back in the window that just ended."""

    def __init__(self, burst: int = RATE_BURST, window_s: float = RATE_WINDOW_S,
                 clock: Any = time.monotonic) -> None:
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._seen: dict[bytes, list[float]] = {}  # kind -> [window start, lines logged, held back]
        self._lock = threading.Lock()

    def allow(self, kind: bytes) -> tuple[bool, int]:
        now = self.clock()
        with self._lock:
            entry = self._seen.get(kind)
            held = 0
            if entry is None or now - entry[0] >= self.window_s:
                held = int(entry[2]) if entry else 0
                if len(self._seen) > 1000:
                    self._seen.clear()
                entry = self._seen[kind] = [now, 0, 0]
            if entry[1] < self.burst:
                entry[1] += 1
                return True, held
            entry[2] += 1
            return False, held


_LIMITER = RateLimiter()
_last_level = [0]


def _on_log(level: int, text: bytes | None, _user: Any) -> None:
    try:
        level = _last_level[0] if level == _CONT else level
        _last_level[0] = level
        if level != _ERROR or not text or not text.strip():
            return
        _log_error_line(text)
    except Exception:  # never raise into C
        pass


def _log_error_line(text: bytes) -> None:
    """One error line of llama.cpp's, cut and rate-limited by its kind (its numbers taken out)."""
    ok, held = _LIMITER.allow(_DIGITS.sub(b"#", text[:200])[:120])
    if held:
        log.error("llama.cpp: %d more lines like the next held back in the last %.0f s", held, RATE_WINDOW_S)
    if ok:
        log.error("llama.cpp: %s", summarize_native_output(text))


@functools.cache
def install_log_callback() -> Any:
    """llama.cpp's log, through edge's callback (kept alive here)."""
    import llama_cpp

    callback = llama_cpp.llama_log_callback(_on_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


class Quiet:
    def __init__(self) -> None:
        self.errors: list[str] = []  # the error lines the block's native log had, summarised


@contextlib.contextmanager
def quiet_load() -> Iterator[Quiet]:
    """llama.cpp's (and ggml's) log to its default logger, C's `stderr` captured in memory, while
    the block runs; then edge's callback again, and the captured error lines logged (rate-limited)
    and kept in `errors` (a load that fails names llama.cpp's reason with them)."""
    import llama_cpp

    callback = install_log_callback()
    out = Quiet()
    if _libc() is None:  # no memstream: the default logger would write every line to the journal
        yield out
        return
    llama_cpp.llama_log_set(ctypes.cast(None, llama_cpp.llama_log_callback), ctypes.c_void_p(0))
    text = Captured()
    try:
        with captured_stderr() as text:
            yield out
    finally:  # a load that failed too: its reason is among the lines
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
        lines = [line for line in text.text.splitlines() if _ERROR_LINE.search(line)]
        out.errors = [summarize_native_output(line) for line in lines]
        for line in lines:
            _log_error_line(line)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        ctypes.c_void_p.in_dll(libc, "stderr")
        return libc
    except (OSError, AttributeError, ValueError):
        return None


class Captured:
    text: bytes = b""


_CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def captured_stderr() -> Iterator[Captured]:
    """C's `stderr` into memory while the block runs (where libc allows; else left as it is)."""
    out, libc = Captured(), _libc()
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size)) if libc is not None else None
    if not stream:
        yield out
        return
    with _CAPTURE_LOCK:
        var = ctypes.c_void_p.in_dll(libc, "stderr")
        old, var.value = var.value, stream
        try:
            yield out
        finally:
            var.value = old
            libc.fclose(stream)
            out.text = ctypes.string_at(buf.value, size.value) if buf.value else b""
            libc.free(buf)
