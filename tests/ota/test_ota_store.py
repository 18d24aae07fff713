"""The content store (edge/ota/store.py) and what rests on it: versions as hard links into it (one
inode per content across versions), thin bundles installed from each kind of base and refused
before writing when the device lacks their content, a copy where links are impossible, pruning
by SemVer and state with garbage collection by reachability, and `edge ota verify`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kit import EDGE
from edge.ota.bundle import build_bundle, open_bundle
from edge.ota.errors import BundleError
from edge.ota.install import Ota
from edge.ota.manifest import read_base
from kit.ota import build_version as build, damage, device, tmpfs, tree

CFG = '[[models]]\nname = "m"\npath = "models/m.gguf"\n'


@pytest.fixture()
def dev(tmp_path: Path):
    return device(tmp_path, model_bytes=64 << 10, keep=3)


def healthy() -> tuple[bool, str]:
    return True, ""


def install(dev, path: Path, ota: Ota | None = None, **kw) -> dict:
    return (ota or dev["ota"]).install(open_bundle(path, dev["pub"]), healthy, **kw)


def edge_ota(dev, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, "ota", *args, "--config", str(dev["cfg"])], capture_output=True, text=True,
                          timeout=120)


def model_of(ota: Ota, version: str) -> os.stat_result:
    return os.stat(ota.versions / version / "models" / "m.gguf")


def test_versions_share_the_model_inode_and_the_store_holds_it_once(dev) -> None:
    ota = dev["ota"]
    for i, v in enumerate(("1.0.0", "1.1.0", "1.2.0")):  # config-only updates
        r = install(dev, build(dev, v, config=CFG + f"# revision {i}\n"))
        assert r["result"] == "committed"
    first, last = model_of(ota, "1.0.0"), model_of(ota, "1.2.0")
    assert (first.st_dev, first.st_ino, first.st_mtime_ns) == (last.st_dev, last.st_ino, last.st_mtime_ns)
    assert first.st_nlink == 4  # the object and three versions
    assert ota.status()["store"] == {"objects": 1, "bytes": 64 << 10}
    assert r["reused_bytes"] == 64 << 10 and r["written_bytes"] == 0  # hashed as it streamed by
    assert not first.st_mode & 0o222  # objects are read-only: a version's file is not a scratch copy


@pytest.mark.parametrize("base_kind", ["bundle", "manifest", "device manifest"])
def test_thin_install_from_each_kind_of_base(dev, base_kind) -> None:
    ota = dev["ota"]
    full = build(dev, "1.0.0")
    install(dev, full)
    base = {"bundle": full, "manifest": dev["dir"] / "1.0.0.json",
            "device manifest": ota.versions / "1.0.0" / "manifest.json"}[base_kind]
    if base_kind == "manifest":
        base.write_bytes(open_bundle(full, dev["pub"]).raw_manifest)
    r = subprocess.run([*EDGE, "ota", "build", "--version", "2.0.0", "--key", str(dev["key"]), "--config",
                        str(_cfg_file(dev, CFG + "# v2\n")), "--model", str(dev["model"]), "--base", str(base),
                        "-o", str(dev["dir"] / "thin.edgeb")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "thin on 1.0.0: carries 0" in r.stdout, r.stderr
    thin = dev["dir"] / "thin.edgeb"
    assert thin.stat().st_size < 16 << 10 < full.stat().st_size
    r = edge_ota(dev, "install", str(thin), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr
    assert model_of(ota, "2.0.0").st_ino == model_of(ota, "1.0.0").st_ino
    assert json.loads(edge_ota(dev, "commit").stdout)["result"] == "committed"
    assert edge_ota(dev, "verify").returncode == 0


def _cfg_file(dev, text: str) -> Path:
    p = dev["dir"] / f"cfg-{abs(hash(text))}.toml"
    p.write_text(text)
    return p


def _as_an_older_edge_left_it(ota: Ota, data: bytes) -> None:
    """The layout before the store: no objects, each version its own plain copy (of `data`)."""
    shutil.rmtree(ota.root / "objects")
    for v in ota.versions.iterdir():
        own = v / "models" / "m.gguf"
        own.unlink()
        own.write_bytes(data)


def test_thin_install_takes_content_from_a_version_an_older_edge_installed(dev) -> None:
    """A thin bundle's file is found through an installed version's manifest, hashed, and
    adopted into the store; a damaged copy is not a source (nothing of the install is kept)."""
    ota = dev["ota"]
    full = build(dev, "1.0.0")
    install(dev, full)
    _as_an_older_edge_left_it(ota, dev["model"].read_bytes())
    install(dev, build(dev, "2.0.0", config=CFG + "# v2\n", base=read_base(full)))
    assert model_of(ota, "2.0.0").st_ino == model_of(ota, "1.0.0").st_ino  # adopted, then linked
    damaged = bytearray(dev["model"].read_bytes())
    damaged[100] ^= 1
    _as_an_older_edge_left_it(ota, bytes(damaged))
    before = tree(ota)
    with pytest.raises(BundleError, match=r"models/m.gguf: the device's copy at .* is damaged"):
        install(dev, build(dev, "3.0.0", config=CFG + "# v3\n", base=read_base(full)))
    assert tree(ota) == before


def test_thin_bundle_whose_content_is_missing_is_refused_before_writing(dev) -> None:
    ota = dev["ota"]
    other = dev["dir"] / "other.gguf"
    other.write_bytes(os.urandom(4096))
    install(dev, build(dev, "1.0.0", model=other))  # this device never had dev["model"]
    base = build(dev, "0.9.0")  # a fleet base this device skipped
    cfg = CFG + '[[models]]\nname = "e"\npath = "models/e.gguf"\n'
    extra = dev["dir"] / "e.gguf"
    extra.write_bytes(os.urandom(2048))
    thin = dev["dir"] / "thin.edgeb"
    build_bundle(thin, version="2.0.0", config=cfg, key=dev["key"], base=read_base(base),
                 files=[(dev["model"], "models/m.gguf", "model", None), (extra, "models/e.gguf", "model", None)])
    before = tree(ota)
    r = edge_ota(dev, "install", str(thin), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert "thin bundle (base 0.9.0) whose content this device does not have intact: models/m.gguf" in r.stderr
    assert "models/e.gguf" not in r.stderr  # it carries that one
    assert "Nothing was written" in r.stderr and tree(ota) == before


def test_signature_covers_the_full_list(dev) -> None:
    """Marking a carried file as not carried (or the reverse) breaks the signature."""
    import io
    import tarfile

    full = build(dev, "1.0.0")
    bad = dev["dir"] / "bad.edgeb"
    with tarfile.open(full) as tin, tarfile.open(bad, "w") as tout:
        for m in tin:
            data = tin.extractfile(m).read()
            if m.name == "manifest.json":
                data = data.replace(b'"kind": "model"', b'"carried": false,\n      "kind": "model"')
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data))
    with pytest.raises(BundleError, match="signature does not verify"):
        open_bundle(bad, dev["pub"])


def test_where_links_are_impossible_files_are_copied_and_the_install_says_so(dev) -> None:
    ota = dev["ota"]
    with tmpfs(ota.versions, "4m"):  # versions/ on another file system than objects/: links are EXDEV
        for v in ("1.0.0", "1.1.0"):
            r = install(dev, build(dev, v, config=CFG + f"# {v}\n"))
            assert r["result"] == "committed" and r["copied"] == ["models/m.gguf (Invalid cross-device link)"]
        assert model_of(ota, "1.0.0").st_ino != model_of(ota, "1.1.0").st_ino
        assert edge_ota(dev, "verify").returncode == 0


def test_prune_keeps_versions_by_semver_and_state_not_by_age(dev) -> None:
    ota = dev["ota"]  # keep 3
    install(dev, build(dev, "1.9.0", model=_model(dev, b"1.9")))
    failing = build(dev, "1.10.0", model=_model(dev, b"1.10"))
    r = ota.install(open_bundle(failing, dev["pub"]), lambda: (ota.link_target("current") != "1.10.0", "sick"))
    assert r["result"] == "rolled back"
    install(dev, build(dev, "1.10.1", model=_model(dev, b"1.10.1")))
    os.utime(ota.versions / "1.10.0", (2e9, 2e9))  # the newest directory by mtime: still the first to go
    assert sorted(d.name for d in ota.versions.iterdir()) == ["1.10.0", "1.10.1", "1.9.0"]
    install(dev, build(dev, "1.11.0", model=_model(dev, b"1.11")))
    assert sorted(d.name for d in ota.versions.iterdir()) == ["1.10.1", "1.11.0", "1.9.0"]
    install(dev, build(dev, "1.12.0", model=_model(dev, b"1.12")))
    assert sorted(d.name for d in ota.versions.iterdir()) == ["1.10.1", "1.11.0", "1.12.0"]  # lowest SemVer went
    used = {json.loads((d / "manifest.json").read_text())["files"][0]["sha256"] for d in ota.versions.iterdir()}
    assert {p.name for p in ota.store.objects.iterdir()} == used  # collected by reachability
    ota.rollback(healthy)  # operator: back to 1.11.0; 1.12.0 was rolled back
    install(dev, build(dev, "1.13.0", model=_model(dev, b"1.13")))
    assert sorted(d.name for d in ota.versions.iterdir()) == ["1.10.1", "1.11.0", "1.13.0"]


def _model(dev, content: bytes) -> Path:
    p = dev["dir"] / f"m-{content.decode()}.gguf"
    p.write_bytes(content * 100)
    return p


def test_verify_finds_a_flipped_byte_in_every_version_that_shares_it(dev) -> None:
    ota = dev["ota"]
    install(dev, build(dev, "1.0.0"))
    install(dev, build(dev, "1.1.0", config=CFG + "# v2\n"))
    r = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["result"] == "ok" and report["hashed_files"] == 1 and set(report["versions"]) == {"1.0.0", "1.1.0"}
    obj = next(ota.store.objects.iterdir())
    data = bytearray(obj.read_bytes())
    data[1234] ^= 0x10
    with open(obj, "r+b") as f:  # in place, as bit-rot would: the same inode
        f.write(data)
    r = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
    assert r.returncode == 65 and "Traceback" not in r.stderr
    assert "versions/1.0.0/models/m.gguf" in r.stderr and "versions/1.1.0/models/m.gguf" in r.stderr
    assert json.loads(r.stdout)["result"] == "damaged"
    (ota.versions / "1.1.0" / "manifest.json").write_text(
        (ota.versions / "1.1.0" / "manifest.json").read_text().replace("# v2", "# v3"))
    r = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
    assert "versions/1.1.0/manifest.json: does not verify with" in r.stderr


def test_a_damaged_object_is_never_linked_into_a_new_version(dev) -> None:
    """Flash bit-rot in the store: a full bundle writes the object anew from its own bytes; a thin
    one that needs it is refused before writing, as for content the device does not have."""
    ota = dev["ota"]
    install(dev, build(dev, "1.0.0"))
    (obj,) = ota.store.objects.iterdir()
    damage(obj)
    thin = build(dev, "1.1.0", config=CFG + "# 1.1\n", base=read_base(build(dev, "1.0.1")))
    before = tree(ota)
    with pytest.raises(BundleError, match="does not have intact: models/m.gguf"):
        install(dev, thin, ota=Ota(ota.root, config=dev["cfg"]))
    assert tree(ota) == before
    r = install(dev, build(dev, "1.2.0", config=CFG + "# 1.2\n"), ota=Ota(ota.root, config=dev["cfg"]))
    assert r["result"] == "committed" and r["written_bytes"] == 64 << 10  # the object, anew
    fresh = ota.versions / "1.2.0" / "models" / "m.gguf"
    assert fresh.read_bytes() == dev["model"].read_bytes()
    r = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
    assert r.returncode == 65 and "1.0.0/models/m.gguf" in r.stderr + r.stdout  # the old links
    assert "1.2.0/models/m.gguf" not in r.stderr + r.stdout


def test_an_install_says_which_pending_version_it_rolled_back_first(dev) -> None:
    ota = dev["ota"]
    install(dev, build(dev, "1.0.0"))
    ota.install(open_bundle(build(dev, "1.1.0", config=CFG + "# 1.1\n"), dev["pub"]), None)  # pending
    r = install(dev, build(dev, "1.2.0", config=CFG + "# 1.2\n"))
    assert r["result"] == "committed" and r["rolled_back_first"] == {
        "failed": "1.1.0", "reason": "still pending (never committed) when the install of 1.2.0 began"}
    assert ota.status()["history"][-3]["reason"].startswith("still pending")


def test_a_deleted_state_json_is_rebuilt_by_the_next_install(dev) -> None:
    ota = dev["ota"]
    install(dev, build(dev, "1.0.0"))
    (ota.root / "state.json").unlink()
    r = edge_ota(dev, "install", str(build(dev, "1.1.0", config=CFG + "# 1.1\n")), "--pubkey",
                 str(dev["pub"]), "--no-activate")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    st = ota.status()
    assert st["pending"]["version"] == "1.1.0" and st["current"] == "1.0.0" and st["highest"] == "1.0.0"
    assert any(e["event"] == "state rebuilt" for e in st["history"])


def test_a_busy_lock_is_try_again_later(dev) -> None:
    import fcntl

    ota = dev["ota"]
    install(dev, build(dev, "1.0.0"))
    with open(ota.root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for args in (["verify", "--pubkey", str(dev["pub"])], ["commit"]):
            r = edge_ota(dev, *args)
            assert r.returncode == 75 and "another edge ota command is running" in r.stderr, r.stderr
