"""A refusal writes nothing, through the real CLI: an install refused for lack of space leaves a
pending version pending (it is checked before the pending version is touched), a refusal that
can only come after that rollback says so, and a refused bundle on a fresh device leaves no OTA
state behind (no lock, no factory copy, no state.json, no versions/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from edge.ota.manifest import read_base
from kit.ota import MODEL_CFG, build_version, device, edge_ota, tmpfs, tree


def test_a_refused_thin_bundle_on_a_fresh_device_leaves_nothing(tmp_path: Path) -> None:
    dev = device(tmp_path, model_bytes=4096, keep=3)
    base = read_base(build_version(dev, "1.0.0"))  # a fleet base this device never had
    thin = build_version(dev, "1.1.0", config=MODEL_CFG + "# 1.1\n", base=base)
    state = tmp_path / "state"
    state.mkdir()
    r = edge_ota(dev, "install", str(thin), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "does not have intact: models/m.gguf" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and list(state.iterdir()) == []  # not even <state_dir>/ota
    full = build_version(dev, "1.0.0")
    r = edge_ota(dev, "install", str(full), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr  # and the device takes its first install as ever


def _pending_on_a_small_fs(dev, mnt: Path) -> None:
    cfg = dev["cfg"]
    cfg.write_text(cfg.read_text().replace(str(dev["dir"] / "state"), str(mnt)))
    for v, extra in (("1.0.0", ["commit"]), ("1.1.0", [])):
        r = edge_ota(dev, "install", str(build_version(dev, v, config=MODEL_CFG + f"# {v}\n")), "--pubkey",
                     str(dev["pub"]), "--no-activate")
        assert r.returncode == 0, r.stderr
        for cmd in extra:
            assert edge_ota(dev, cmd).returncode == 0


def test_an_install_refused_for_space_leaves_the_pending_version_pending(tmp_path: Path) -> None:
    dev = device(tmp_path, model_bytes=64 << 10, keep=3)
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        _pending_on_a_small_fs(dev, mnt)
        big = dev["dir"] / "big.gguf"
        big.write_bytes(os.urandom(4 << 20))  # more than the file system holds
        ota = type(dev["ota"])(mnt / "ota")
        before = tree(ota)
        r = edge_ota(dev, "install", str(build_version(dev, "2.0.0", model=big)), "--pubkey", str(dev["pub"]),
                     "--no-activate")
        assert r.returncode == 65 and "nothing was written" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert tree(ota) == before  # 1.1.0 still pending, current still linked to it
        st = json.loads(edge_ota(dev, "status").stdout)
        assert st["pending"]["version"] == "1.1.0" and st["links"]["current"] == "1.1.0"


def test_a_refusal_that_comes_after_the_pending_rollback_says_so(tmp_path: Path) -> None:
    """The thin bundle's content is only in the pending version; rolling that back (keep 2)
    prunes it, so the content check made again under the lock refuses, and names the rollback."""
    dev = device(tmp_path, model_bytes=4096, keep=2)
    dev["cfg"].write_text(dev["cfg"].read_text() + "[ota]\nkeep_versions = 2\n")
    committed = [build_version(dev, v, config=MODEL_CFG + f"# {v}\n", model=_random(dev, v)) for v in ("1.0.0", "1.1.0")]
    for b in committed:
        assert edge_ota(dev, "install", str(b), "--pubkey", str(dev["pub"]), "--no-activate").returncode == 0
        assert edge_ota(dev, "commit").returncode == 0
    pending = build_version(dev, "1.2.0", config=MODEL_CFG + "# 1.2\n", model=_random(dev, "1.2.0"))
    assert edge_ota(dev, "install", str(pending), "--pubkey", str(dev["pub"]), "--no-activate").returncode == 0
    thin = build_version(dev, "1.3.0", config=MODEL_CFG + "# 1.3\n", model=dev["dir"] / "m-1.2.0.gguf",
                         base=read_base(pending))
    r = edge_ota(dev, "install", str(thin), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert "before that, the pending version 1.2.0 was rolled back" in r.stderr
    st = json.loads(edge_ota(dev, "status").stdout)
    assert st["pending"] is None and st["current"] == "1.1.0" and st["history"][-1]["event"] == "rolled back"


def _random(dev, version: str) -> Path:
    p = dev["dir"] / f"m-{version}.gguf"
    p.write_bytes(os.urandom(4096))
    return p
