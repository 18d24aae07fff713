"""A repair covers what the manifest says and is never a lock-out (edge/ota/repair.py,
edge/ota/audit.py, edge/ota/recheck.py), through the real CLI: each way a file can differ from
its manifest (a symlink, to a file outside or to its own object; mode 0000 or 0666; a copy where
the store's object should be; a damaged object beside an intact copy; a deleted file) is repaired
by a boot and by the version's bundle; a boot hashes what it can afford, and in full after an
interrupted repair; the prune keeps every object a version links, whatever its manifest says;
losing both state slots never makes a damaged manifest the record; an --insecure push never
replaces a signature that verifies. The generated kill matrix is test_ota_repair_matrix.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from edge.fsutil import sha256_file
from kit.ota import MODEL_CFG, build_version, damage, device, edge_ota


@pytest.fixture()
def dev(tmp_path: Path):
    d = device(tmp_path, model_bytes=64 << 10, keep=3)
    d["cfg"].write_text(d["cfg"].read_text() + f'[ota]\npubkey = "{d["pub"]}"\n')
    return d


def ota_ok(dev, *args: str) -> dict:
    r = edge_ota(dev, *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def committed(dev, bundle: Path, *extra: str) -> None:
    ota_ok(dev, "install", str(bundle), "--no-activate", *extra)
    ota_ok(dev, "commit")


def problems(dev) -> str:
    r = edge_ota(dev, "verify")
    assert r.returncode in (0, 65) and "Traceback" not in r.stderr, r.stderr
    return "" if r.returncode == 0 else r.stderr


def _object(dev, version: str = "1.0.0") -> Path:
    sha = json.loads((dev["ota"].versions / version / "manifest.json").read_text())["files"][0]["sha256"]
    return dev["ota"].store.object(sha)


def _harm(dev, how: str) -> None:
    model = dev["ota"].root / "current" / "models" / "m.gguf"
    obj = _object(dev)
    if how.startswith("a symlink"):
        target = obj if "own object" in how else dev["dir"] / "outside.gguf"
        if target != obj:
            target.write_bytes(model.read_bytes())
        model.unlink()
        model.symlink_to(target)
    elif how.startswith("mode"):
        model.chmod(int(how.split()[1], 8))
    elif how.startswith("a copy") or how.startswith("a damaged object"):
        copy = model.with_name("copy")
        copy.write_bytes(model.read_bytes())
        copy.chmod(0o444)
        copy.replace(model)
        if how.startswith("a damaged object"):
            damage(obj)
    elif how == "deleted":
        model.unlink()


HARMS = ["a symlink to a file outside with the right bytes", "a symlink to its own object", "mode 0000", "mode 0666",
         "a copy, not its object", "a damaged object beside an intact copy", "deleted"]


def _whole(dev) -> None:
    """The current version's file is its intact store object, read-only, and nothing is damaged."""
    model = dev["ota"].root / "current" / "models" / "m.gguf"
    st, obj = os.lstat(model), _object(dev)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
    assert (st.st_dev, st.st_ino) == (os.stat(obj).st_dev, os.stat(obj).st_ino)
    assert sha256_file(model) == obj.name and problems(dev) == ""


@pytest.mark.parametrize("how", HARMS)
@pytest.mark.parametrize("by", ["recover --boot", "its bundle"])
def test_a_repair_covers_what_the_manifest_says_not_only_bytes(dev, how: str, by: str) -> None:
    bundle = build_version(dev, "1.0.0")
    committed(dev, bundle)
    _harm(dev, how)
    assert "versions/1.0.0/models/m.gguf" in problems(dev)
    if by == "recover --boot":
        answer = ota_ok(dev, "recover", "--boot")
    else:
        answer = ota_ok(dev, "install", str(bundle), "--no-activate")
    assert answer["result"] == "repaired" and answer["version"] == "1.0.0", answer
    assert answer["checked"]["repaired"][0].startswith("models/m.gguf (was ")
    _whole(dev)


def test_a_boot_samples_and_hashes_in_full_after_an_interrupted_repair(dev) -> None:
    """4 MiB: a boot reads its sampled windows, so a bit between them is for `edge ota verify`
    (and the full hash of a boot after an interrupted repair); edge.toml changed is seen at once."""
    big = dev["dir"] / "big.gguf"
    big.write_bytes(os.urandom(4 << 20))
    bundle = build_version(dev, "1.0.0", model=big)
    committed(dev, bundle)
    committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))
    ota_ok(dev, "install", str(bundle), "--no-activate", "--allow-downgrade")  # 1.0.0 current again, 2.0.0 before
    ota_ok(dev, "commit")
    model = dev["ota"].root / "current" / "models" / "m.gguf"
    damage(model, at=100 << 10)  # between the first and the second sampled window
    assert ota_ok(dev, "recover", "--boot")["result"] == "nothing pending"  # what a boot can afford
    assert "versions/1.0.0/models/m.gguf" in problems(dev)
    # a repair interrupted (killed at its first file operation after its record was written): the next
    # boot hashes in full, finds the bit, and, with no intact copy here, serves the version before
    (dev["ota"].root / "current" / "edge.toml").write_text(MODEL_CFG + "# not the signed config\n")
    log = dev["dir"] / "ops.log"
    ok = edge_ota(dev, "recover", "--boot", env={"EDGE_OTA_FS_LOG": str(log)})
    assert ok.returncode == 0 and json.loads(ok.stdout)["result"] == "repaired", ok.stderr
    (dev["ota"].root / "current" / "edge.toml").write_text(MODEL_CFG + "# not the signed config\n")
    ops = log.read_text().splitlines()
    after = next(i for i, o in enumerate(ops) if " exchange " in o) + 2  # the first op after the record
    r = edge_ota(dev, "recover", "--boot", env={"EDGE_OTA_KILL_AT_OP": str(after)})
    assert r.returncode == 137, (ops[after - 1], r.stderr)
    assert json.loads(edge_ota(dev, "status").stdout)["repair"]["version"] == "1.0.0"
    answer = ota_ok(dev, "recover", "--boot")
    assert answer["result"] == "rolled back" and answer["version"] == "2.0.0" and answer["removed"] == "1.0.0"
    assert "damaged beyond repair on this device" in answer["reason"] and problems(dev) == ""


def test_the_prune_keeps_every_object_a_version_links_whatever_its_manifest_says(dev) -> None:
    other = dev["dir"] / "other.gguf"
    other.write_bytes(os.urandom(64 << 10))
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, build_version(dev, "2.0.0", model=other))
    live = _object(dev, "2.0.0")
    manifest = dev["ota"].versions / "2.0.0" / "manifest.json"
    data = json.loads(manifest.read_text())
    sha = data["files"][0]["sha256"]
    data["files"][0]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]  # one digit: valid JSON
    manifest.write_text(json.dumps(data))
    assert ota_ok(dev, "recover")["result"] == "nothing pending"  # its prune (not a boot: no look at 2.0.0)
    third = dev["dir"] / "third.gguf"
    third.write_bytes(os.urandom(64 << 10))
    committed(dev, build_version(dev, "3.0.0", model=third))  # its prune
    assert live.is_file() and sha256_file(live) == live.name


def test_losing_both_state_slots_never_makes_a_damaged_manifest_the_record(dev) -> None:
    """A hash digit changed in the only version's manifest, then both state slots lost: the
    rebuild takes no digest from a manifest that does not verify, so the version's own signed
    bundle repairs it (no "other content" lock-out), before and after a boot's recover."""
    bundle = build_version(dev, "1.0.0")
    committed(dev, bundle)
    vdir = dev["ota"].versions / "1.0.0"
    data = json.loads((vdir / "manifest.json").read_text())
    sha = data["files"][0]["sha256"]
    data["files"][0]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]
    (vdir / "manifest.json").write_text(json.dumps(data))
    for slot in ("state.json", "state.json.prev"):
        (dev["ota"].root / slot).write_bytes(b"")
    r = edge_ota(dev, "recover", "--boot")  # the manifest does not verify, and there is nothing before it
    assert r.returncode == 65 and "no version before 1.0.0 to fall back to" in r.stderr, r.stderr
    assert "1.0.0" not in json.loads((dev["ota"].root / "state.json").read_text())["digests"]
    answer = ota_ok(dev, "install", str(bundle), "--no-activate")
    assert answer["result"] == "repaired"
    assert "manifest.json and manifest.sig (from the bundle: its signed manifest)" in answer["checked"]["repaired"]
    assert problems(dev) == ""


def test_an_insecure_push_never_replaces_a_signature_that_verifies(dev, tmp_path: Path) -> None:
    """The same content built and signed elsewhere, pushed with --insecure over the signed
    version: its manifest.sig stays the one that verifies, and a rollback to it is taken."""
    from edge.ota.bundle import build_bundle, keygen

    committed(dev, build_version(dev, "1.0.0"))
    sig = (dev["ota"].versions / "1.0.0" / "manifest.sig").read_bytes()
    elsewhere = tmp_path / "elsewhere.key"
    keygen(elsewhere)
    unsigned = tmp_path / "1.0.0-elsewhere.edgeb"
    build_bundle(unsigned, version="1.0.0", files=[(dev["model"], "models/m.gguf", "model", None)],
                 config=MODEL_CFG, key=elsewhere)
    answer = ota_ok(dev, "install", str(unsigned), "--insecure", "--no-activate")
    assert answer["result"] == "already-current", answer
    assert (dev["ota"].versions / "1.0.0" / "manifest.sig").read_bytes() == sig and problems(dev) == ""
    committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))
    assert ota_ok(dev, "rollback", "--no-activate")["version"] == "1.0.0"


def test_what_root_installs_under_the_units_umask_the_service_can_read(dev) -> None:
    """`edge ota` run as ExecStartPre=+ (or by Mender) keeps the unit's UMask=0077: every folder
    it makes is 0755 and every file readable by the service's (dynamic) user: the config, the
    models (0444), the state the fleet metrics read."""
    import subprocess

    from kit import EDGE

    def under_umask(*args: str) -> None:
        r = subprocess.run([*EDGE, "ota", *args, "--config", str(dev["cfg"])], capture_output=True, text=True,
                           timeout=120, preexec_fn=lambda: os.umask(0o077))
        assert r.returncode == 0, r.stderr

    under_umask("recover", "--boot")  # the first: OTA takes over (the factory config)
    under_umask("install", str(build_version(dev, "1.0.0")), "--no-activate")
    under_umask("commit")
    for p in dev["ota"].root.rglob("*"):
        if p.is_symlink() or p.name == ".lock":
            continue
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == 0o755 if p.is_dir() else mode & 0o044 == 0o044, (p, oct(mode))
    assert stat.S_IMODE((dev["ota"].root / "current" / "models" / "m.gguf").stat().st_mode) == 0o444


@pytest.mark.parametrize("harm", ["its model lost a bit", "its manifest.sig zeroed"])
def test_a_boot_with_a_damaged_version_to_go_back_to_serves_the_intact_one_before_it(dev, harm: str) -> None:
    """3.0.0 pending (a power cut before its commit), 2.0.0 to go back to damaged beyond repair on
    this device: recover --boot serves 1.0.0 (checked in full), removes 2.0.0, and says why;
    the failed update is not left pending and served."""
    models = {}
    for v in ("1.0.0", "2.0.0", "3.0.0"):
        models[v] = dev["dir"] / f"{v}.gguf"
        models[v].write_bytes(os.urandom(64 << 10))
        bundle = build_version(dev, v, config=MODEL_CFG + f"# {v}\n", model=models[v])
        if v != "3.0.0":
            committed(dev, bundle)
    vdir = dev["ota"].versions / "2.0.0"
    if harm.startswith("its model"):
        damage(vdir / "models" / "m.gguf")
    else:
        (vdir / "manifest.sig").write_bytes(b"\0" * 64)
    ota_ok(dev, "install", str(dev["dir"] / "3.0.0.edgeb"), "--no-activate")  # pending, never committed
    answer = ota_ok(dev, "recover", "--boot")
    assert answer["result"] == "rolled back" and answer["failed"] == "3.0.0" and answer["version"] == "1.0.0", answer
    assert answer["instead"].startswith("1.0.0: 3.0.0 cannot be rolled back") and "2.0.0" in answer["instead"]
    st = json.loads(edge_ota(dev, "status").stdout)
    assert st["current"] == "1.0.0" and st["pending"] is None and st["links"]["current"] == "1.0.0"
    assert "2.0.0" not in st["on_disk"] and problems(dev) == ""
    assert sha256_file(dev["ota"].root / "current" / "models" / "m.gguf") == sha256_file(models["1.0.0"])
