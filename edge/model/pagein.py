"""Page-in: read a model or engine file into the page cache before it is needed.

Several reader threads pull chunks in file order (os.preadv releases the GIL), so the read runs
beside the Python imports of start-up instead of after them, and llama.cpp's mmap then finds the
pages resident. An optional sha256 is computed by one more thread from the same, now warm, pages.
Only the chunks holding a page that is not resident (mincore) are read; where every page is,
no reader starts: reading a resident 253 MB file cost a start some 80 ms of CPU on the project's
2-core VM, taken from the imports and the validation beside it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PageIn", "PageInResult", "resident_fraction", "evict"]

CHUNK = 8 << 20
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each byte = page resident


@dataclass(frozen=True)
class PageInResult:
    path: str
    bytes: int
    seconds: float
    resident_before: float | None
    sha256: str | None
    read: bool  # False: every page was resident, nothing was read
    start_s: float  # monotonic clock values, for the start report
    end_s: float

    def as_detail(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path}
        if self.resident_before is not None:
            d["resident_before"] = round(self.resident_before, 3)
        if not self.read:
            d["reads"] = "none: every page resident"
        if self.sha256:
            d["sha256"] = self.sha256
        return d


class PageIn:
    """Start with start(); the caller goes on with other work; result() joins the readers."""

    def __init__(self, path: str | Path, *, threads: int = 4, hash_sha256: bool = False) -> None:
        self.path = str(path)
        self.threads = max(0, threads)  # 0: only hash (prefetch disabled)
        self.hash_sha256 = hash_sha256
        self._workers: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._digest: str | None = None
        self._size = 0
        self._t0 = 0.0
        self._ends: list[float] = []  # when each reader finished: the page-in's real end

    def start(self) -> "PageIn":
        self._t0 = time.monotonic()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        pages = residency(self._fd, self._size)
        self._resident = _fraction(pages)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_WILLNEED)
        todo = _missing_chunks(pages, self._size)
        chunks = iter(todo)
        lock = threading.Lock()
        self._read = bool(todo)  # residency unknown, or some pages out: read those chunks
        for i in range(min(self.threads, len(todo))):
            t = threading.Thread(target=self._guard, args=(self._read_chunks, chunks, lock),
                                 name=f"edge-pagein-{i}", daemon=True)
            self._workers.append(t)
        if self.hash_sha256:
            self._workers.append(threading.Thread(target=self._guard, args=(self._hash,),
                                                  name="edge-sha256", daemon=True))
        for t in self._workers:
            t.start()
        self._started = time.monotonic()
        return self

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # surfaced by result(), never lost in a thread
            self._errors.append(exc)
        finally:
            self._ends.append(time.monotonic())

    def _read_chunks(self, chunks: Iterator[int], lock: threading.Lock) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            with lock:
                offset = next(chunks, None)
            if offset is None:
                return
            os.preadv(self._fd, [view], offset)

    def _hash(self) -> None:
        h = hashlib.sha256()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        offset = 0
        while offset < self._size:
            n = os.preadv(self._fd, [view], offset)
            if n <= 0:
                break
            h.update(view[:n])
            offset += n
        self._digest = h.hexdigest()

    def result(self) -> PageInResult:
        for t in self._workers:
            t.join()
        end = max(self._ends, default=self._started)  # no thread: what start() took
        os.close(self._fd)
        if self._errors:
            raise self._errors[0]
        return PageInResult(path=self.path, bytes=self._size, seconds=end - self._t0,
                            resident_before=self._resident, sha256=self._digest,
                            read=self._read and self.threads > 0,
                            start_s=self._t0, end_s=end)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's functions, from the process's own symbols (no ctypes.util lookup)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore  # noqa: B018 (present, or this is no C library to call)
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def resident_fraction(fd: int, size: int) -> float | None:
    """Fraction of the file's pages already in the page cache (mincore), None if unknown."""
    return _fraction(residency(fd, size))


def _fraction(pages: bytes | None) -> float | None:
    return pages.translate(_LOW_BIT).count(1) / len(pages) if pages else None


def _missing_chunks(pages: bytes | None, size: int) -> list[int]:
    """The offsets of the CHUNKs holding a page that is not resident (every chunk where unknown)."""
    if pages is None:
        return list(range(0, size, CHUNK))
    per = CHUNK // os.sysconf("SC_PAGE_SIZE")  # pages per chunk
    low = pages.translate(_LOW_BIT)
    return [i * CHUNK for i in range((len(low) + per - 1) // per) if 0 in low[i * per:(i + 1) * per]]


def residency(fd: int, size: int) -> bytes | None:
    """One byte per page of the file, bit 0 set where it is in the page cache (mincore); None
    where that cannot be known."""
    libc = _libc()
    if libc is None or size == 0:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    addr = libc.mmap(None, size, 0x1, 0x1, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = (size + page - 1) // page
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, size, vec) != 0:
            return None
        return vec.raw
    finally:
        libc.munmap(addr, size)


def evict(path: str | Path) -> None:
    """Drop a file's clean pages from the page cache (for cold-start benchmarks)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
