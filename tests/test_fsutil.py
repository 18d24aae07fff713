"""The modes of what edge writes (edge.fsutil): its own files 0600 and folders 0700 whatever the
umask; what is written for others to read, as asked. The service's files as another user reads
them: tests/lifecycle/test_private_files.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from edge.fsutil import atomic_write, private_dir


def test_atomic_write_and_private_dir_ignore_the_umask(tmp_path: Path) -> None:
    umask = os.umask(0)
    try:
        folder = private_dir(tmp_path / "a" / "b")
        atomic_write(folder / "private.json", json.dumps({"prompt": "a secret"}))
        atomic_write(folder / "public.txt", "x", mode=0o644)
        atomic_write(folder / "umask.txt", "x", mode=None)
        old = tmp_path / "old"  # a folder of an earlier edge, more open than it should be
        old.mkdir(mode=0o755)
        private_dir(old)
    finally:
        os.umask(umask)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "a") == mode(folder) == mode(old) == 0o700
    assert mode(folder / "private.json") == 0o600 and mode(folder / "public.txt") == 0o644
    assert mode(folder / "umask.txt") == 0o666  # what a umask of 0 gives
    umask = os.umask(0o777)  # nothing allowed at all: edge's own folders and files still work for it
    try:
        atomic_write(private_dir(tmp_path / "c") / "f", "x")
    finally:
        os.umask(umask)
    assert mode(tmp_path / "c") == 0o700 and mode(tmp_path / "c" / "f") == 0o600
