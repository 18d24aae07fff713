"""Staging (edge/ota/stage.py) when the file system fills up under it: before every one of an
install's file-system operations in turn, the free blocks or the free inodes are used up (after
the free-space check passed, as another writer would). Every install then either completes or
ends in one clear refusal, never a traceback; nothing of the new version is left, and once space
is freed the same bundle installs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from edge.ota.bundle import build_bundle, keygen, open_bundle
from edge.ota.errors import BundleError, OtaStateError
from edge.ota.fsops import Fs
from edge.ota.install import Ota
from kit.ota import fill, tmpfs

CFG = '[[models]]\nname = "m"\npath = "models/m.gguf"\n'


class FillBeforeOp(Fs):
    """The real operations; the file system is filled by real files just before operation `at`
    (a fault injector, like EDGE_OTA_KILL_AT_OP, not a double)."""

    def __init__(self, mnt: Path, at: int, blocks: bool, inodes: bool) -> None:
        super().__init__()
        self.mnt, self.at, self.how = mnt, at, (blocks, inodes)
        self.filler: Path | None = None

    def op(self, name: str, path: Path | str) -> None:
        super().op(name, path)
        if self.count == self.at:
            self.filler = fill(self.mnt, *self.how)


def _bundles(tmp_path: Path) -> tuple[Path, Path, Path]:
    key = tmp_path / "signing.key"
    pub = keygen(key)
    out = []
    for v in ("1.0.0", "2.0.0"):
        model = tmp_path / f"{v}.gguf"
        model.write_bytes(os.urandom(48 << 10))
        out.append(tmp_path / f"{v}.edgeb")
        build_bundle(out[-1], version=v, files=[(model, "models/m.gguf", "model", None)], config=CFG, key=key)
    return pub, out[0], out[1]


@pytest.mark.parametrize("full", ["blocks", "inodes"])
def test_a_file_system_that_fills_before_any_install_operation(tmp_path: Path, full: str) -> None:
    pub, first, second = _bundles(tmp_path)
    how = (full == "blocks", full == "inodes")
    with tmpfs(tmp_path / "mnt", "3m", 300) as mnt:
        template = mnt / "template"
        Ota(template, keep=2).install(open_bundle(first, pub), lambda: (True, ""))
        counting = Fs()
        shutil.copytree(template, mnt / "ota", symlinks=True)
        Ota(mnt / "ota", keep=2, fs=counting).install(open_bundle(second, pub), lambda: (True, ""))
        outcomes = set()
        for at in range(1, counting.count + 1):
            shutil.rmtree(mnt / "ota")
            shutil.copytree(template, mnt / "ota", symlinks=True)
            fs = FillBeforeOp(mnt, at, *how)
            ota = Ota(mnt / "ota", keep=2, fs=fs)
            try:
                outcomes.add(ota.install(open_bundle(second, pub), lambda: (True, ""))["result"])
            except (BundleError, OtaStateError) as exc:
                assert "full" in str(exc) or "free" in str(exc), (at, exc)
                outcomes.add("refused")
            assert fs.filler is not None
            shutil.rmtree(fs.filler)
            ota = Ota(mnt / "ota", keep=2)
            ota.recover(None)
            st = ota.status()
            assert st["pending"] is None and st["links"]["current"] == st["current"] in ("1.0.0", "2.0.0"), at
            assert not list(ota.versions.glob(".staging-*")) and not list((ota.root / "objects" / "tmp").iterdir())
            assert ota.install(open_bundle(second, pub), lambda: (True, ""))["result"] in ("committed", "already-current")
        assert outcomes == {"refused", "committed"}
