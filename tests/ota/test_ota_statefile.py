"""The OTA's durable records on a full file system and after damage (edge/ota/statefile.py,
edge/ota/rebuild.py): every state write (install's PENDING, commit, rollback) with no free block
or no free inode left, then `edge ota recover --boot`, `commit` and `install` on that full file
system; an empty, non-JSON or missing state.json is rebuilt from the links, .complete markers
and manifests, says so, and the device converges and can still be updated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kit import EDGE
from edge.ota.bundle import build_bundle, keygen, open_bundle
from edge.ota.fsops import Fs
from edge.ota.install import Ota
from kit.ota import fill, tmpfs

CFG = '[[models]]\nname = "m"\npath = "models/m.gguf"\n'
FULL = {"blocks": (True, False), "inodes": (False, True)}


class FillAt(Fs):
    """The real file-system operations; just before the state write that enters `moment`,
    the file system is filled (blocks or inodes) by real files. Not a double: a fault injector,
    like EDGE_OTA_KILL_AT_OP."""

    def __init__(self, mnt: Path, writes_before: int, blocks: bool, inodes: bool) -> None:
        super().__init__()
        self.mnt, self.left, self.how = mnt, writes_before, (blocks, inodes)
        self.filler: Path | None = None

    def overwrite(self, path: Path, data: bytes) -> None:
        if path.name == "state.json.prev" and self.filler is None:
            if self.left == 0:
                self.filler = fill(self.mnt, *self.how)
            self.left -= 1
        super().overwrite(path, data)


@pytest.fixture()
def dev(tmp_path: Path):
    key = tmp_path / "signing.key"
    pub = keygen(key)
    bundles = {}
    for v in ("1.0.0", "2.0.0", "3.0.0"):
        model = tmp_path / f"m{v}.gguf"
        model.write_bytes(os.urandom(32 << 10))
        bundles[v] = tmp_path / f"{v}.edgeb"
        build_bundle(bundles[v], version=v, files=[(model, "models/m.gguf", "model", None)], config=CFG, key=key)
    return {"dir": tmp_path, "pub": pub, "bundles": bundles}


def _device(dev, root: Path) -> Path:
    cfg = dev["dir"] / "device.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{root}"\n[[models]]\nname = "x"\npath = "/x.gguf"\n')
    return cfg


def edge_ota(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, "ota", *args, "--config", str(cfg)], capture_output=True, text=True, timeout=120)


def _agree(ota: Ota, current: str, pending: str | None = None) -> None:
    st = ota.status()
    assert st["current"] == current and (st["pending"] or {}).get("version") == pending
    assert st["links"]["current"] == (pending or current)
    assert (ota.root / "current" / "edge.toml").is_file()


@pytest.mark.parametrize("full", FULL)
@pytest.mark.parametrize("moment", ["pending", "commit", "rollback"])
def test_a_full_file_system_at_every_state_write(dev, tmp_path: Path, full: str, moment: str) -> None:
    with tmpfs(tmp_path / "mnt", "3m", 400) as mnt:
        ota = Ota(mnt / "ota", keep=2)
        ota.install(open_bundle(dev["bundles"]["1.0.0"], dev["pub"]), lambda: (True, ""))
        writes_before = {"pending": 0, "commit": 1, "rollback": 1}[moment]
        fs = FillAt(mnt, writes_before, *FULL[full])
        sick = moment == "rollback"
        result = Ota(mnt / "ota", keep=2, fs=fs).install(
            open_bundle(dev["bundles"]["2.0.0"], dev["pub"]),
            lambda: (not sick or ota.link_target("current") != "2.0.0", "sick"))  # only 2.0.0 is sick
        assert fs.filler is not None  # the file system was full at that write
        assert result["result"] == ("rolled back" if sick else "committed")
        _agree(ota, "1.0.0" if sick else "2.0.0")
        _still_updatable(dev, mnt, ota, fs.filler, "3.0.0")


def _still_updatable(dev, mnt: Path, ota: Ota, filler: Path, version: str) -> None:
    """On the full file system: recover --boot converges, install refuses clearly; freed, it installs."""
    cfg = _device(dev, mnt)
    r = edge_ota(cfg, "recover", "--boot")
    assert r.returncode == 0, r.stderr
    r = edge_ota(cfg, "install", str(dev["bundles"][version]), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "Traceback" not in r.stderr and "nothing was written" in r.stderr, r.stderr
    shutil.rmtree(filler)
    r = edge_ota(cfg, "install", str(dev["bundles"][version]), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr
    assert edge_ota(cfg, "commit").returncode == 0
    _agree(ota, version)


@pytest.mark.parametrize("full", FULL)
def test_pending_on_a_full_file_system_recover_boot_rolls_back_and_commit_works(dev, tmp_path: Path, full) -> None:
    """The audit's case: switched, not committed, disk full; then a reboot (recover --boot)."""
    with tmpfs(tmp_path / "mnt", "3m", 400) as mnt:
        cfg = _device(dev, mnt)
        ota = Ota(mnt / "ota", keep=2)
        ota.install(open_bundle(dev["bundles"]["1.0.0"], dev["pub"]), lambda: (True, ""))
        ota.install(open_bundle(dev["bundles"]["2.0.0"], dev["pub"]), None)  # PENDING
        filler = fill(mnt, *FULL[full])
        r = edge_ota(cfg, "commit")
        assert r.returncode == 0 and json.loads(r.stdout)["result"] == "committed", r.stderr
        shutil.rmtree(filler)
        ota.install(open_bundle(dev["bundles"]["3.0.0"], dev["pub"]), None)  # PENDING again
        filler = fill(mnt, *FULL[full])
        _agree(ota, "2.0.0", pending="3.0.0")
        r = edge_ota(cfg, "recover", "--boot")
        assert r.returncode == 0 and json.loads(r.stdout)["result"] == "rolled back", r.stderr
        _agree(ota, "2.0.0")  # the never-committed 3.0.0 is not served after the reboot
        assert ota.state()["history"][-1]["event"] == "rolled back"


DAMAGE = {"empty": b"", "not JSON": b'{"current": "2.0', "missing": None, "a list": b"[]"}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_state_json_is_rebuilt_said_and_converges(dev, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "state"
    cfg = _device(dev, root)
    for v in ("1.0.0", "2.0.0"):
        assert edge_ota(cfg, "install", str(dev["bundles"][v]), "--pubkey", str(dev["pub"]), "--no-activate").returncode == 0
        assert edge_ota(cfg, "commit").returncode == 0
    state = root / "ota" / "state.json"
    state.unlink()
    if DAMAGE[damage] is not None:
        state.write_bytes(DAMAGE[damage])
    r = edge_ota(cfg, "status")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    st = json.loads(r.stdout)
    assert st["current"] == "2.0.0" and st["previous"] == "1.0.0" and st["highest"] == "2.0.0"
    assert "rebuilt from the links, .complete markers and manifests" in st["rebuilt"]
    r = edge_ota(cfg, "recover", "--boot")
    assert r.returncode == 0 and "rebuilt from the links" in json.loads(r.stdout)["rebuilt"], r.stderr
    st = json.loads(state.read_text())  # written again, whole
    assert st["current"] == "2.0.0" and st["history"][-1]["event"] == "state rebuilt"
    r = edge_ota(cfg, "install", str(dev["bundles"]["1.0.0"]), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "older than 2.0.0" in r.stderr  # the policy survived the rebuild
    assert edge_ota(cfg, "install", str(dev["bundles"]["3.0.0"]), "--pubkey", str(dev["pub"]),
                    "--no-activate").returncode == 0


def test_damage_while_pending_rolls_the_unconfirmed_version_back(dev, tmp_path: Path) -> None:
    """Both slots lost while 3.0.0 is pending: its marker says it was never committed, so the
    rebuild makes it pending again and the boot-time recover rolls it back."""
    root = tmp_path / "state"
    cfg = _device(dev, root)
    for v in ("1.0.0", "2.0.0"):
        edge_ota(cfg, "install", str(dev["bundles"][v]), "--pubkey", str(dev["pub"]), "--no-activate")
        edge_ota(cfg, "commit")
    assert edge_ota(cfg, "install", str(dev["bundles"]["3.0.0"]), "--pubkey", str(dev["pub"]),
                    "--no-activate").returncode == 0
    for name in ("state.json", "state.json.prev"):
        (root / "ota" / name).write_bytes(b"\0" * 100)
    st = json.loads(edge_ota(cfg, "status").stdout)
    assert st["pending"]["version"] == "3.0.0" and st["current"] == "2.0.0"
    assert "3.0.0 was never committed" in st["rebuilt"]
    r = edge_ota(cfg, "recover", "--boot")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "rolled back", r.stderr
    st = json.loads(edge_ota(cfg, "status").stdout)
    assert st["current"] == "2.0.0" and st["links"]["current"] == "2.0.0" and st["pending"] is None
