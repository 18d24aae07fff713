import hashlib
import os
import time
from pathlib import Path

import pytest

from edge.model.pagein import PageIn, evict, resident_fraction


def _file(tmp_path: Path, size: int) -> Path:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(size))
    return p


def test_pagein_reads_everything_and_hashes(tmp_path: Path) -> None:
    p = _file(tmp_path, 20 << 20 | 12345)
    t0 = time.monotonic()
    res = PageIn(p, threads=3, hash_sha256=True).start().result()
    t1 = time.monotonic()
    assert res.bytes == p.stat().st_size
    assert res.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    # The result's clock is the caller's monotonic clock (the start report relies on it).
    assert t0 <= res.start_s < res.end_s <= t1
    assert res.seconds == pytest.approx(res.end_s - res.start_s)


def test_eviction_then_pagein_brings_pages_back(tmp_path: Path) -> None:
    p = _file(tmp_path, 8 << 20)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        evict(p)
        before = resident_fraction(fd, p.stat().st_size)
        res = PageIn(p, threads=2).start().result()
        after = resident_fraction(fd, p.stat().st_size)
    finally:
        os.close(fd)
    if before is None:
        pytest.skip("no mincore on this platform: residency cannot be measured")
    if before > 0.5:
        pytest.skip(f"this file system keeps the pages ({before:.0%} resident after eviction; tmpfs?)")
    assert res.resident_before is not None and res.resident_before <= 0.5
    assert res.read is True and "reads" not in res.as_detail()  # pages out: the readers ran
    assert after == 1.0


def test_hash_only_mode_reads_with_no_prefetch_threads(tmp_path: Path) -> None:
    p = _file(tmp_path, 1 << 20)
    res = PageIn(p, threads=0, hash_sha256=True).start().result()
    assert res.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_file_whose_pages_are_all_resident_is_not_read_again(tmp_path: Path) -> None:
    p = _file(tmp_path, 4 << 20)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.read(fd, p.stat().st_size + 1)  # every page in the page cache
        if resident_fraction(fd, p.stat().st_size) != 1.0:
            pytest.skip("mincore cannot say this file is resident here")
    finally:
        os.close(fd)
    pagein = PageIn(p, threads=4).start()
    assert pagein._workers == []  # no reader started: nothing to read
    res = pagein.result()
    assert res.resident_before == 1.0 and res.read is False
    assert res.as_detail()["reads"] == "none: every page resident"
    assert res.start_s <= res.end_s


def test_only_the_chunks_with_pages_out_are_read(tmp_path: Path) -> None:
    from edge.model.pagein import CHUNK, _missing_chunks

    page = os.sysconf("SC_PAGE_SIZE")
    per = CHUNK // page
    size = 3 * CHUNK + 5 * page  # three whole chunks and a short last one
    pages = bytearray(b"\x01" * (size // page))
    pages[per + 7] = 0  # one page out in the second chunk
    pages[-1] = 0x80  # only a high bit set: not resident (bit 0 says it)
    assert _missing_chunks(bytes(pages), size) == [CHUNK, 3 * CHUNK]
    assert _missing_chunks(b"\x01" * (size // page), size) == []
    assert _missing_chunks(None, size) == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]  # unknown: everything
