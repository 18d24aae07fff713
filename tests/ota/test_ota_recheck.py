"""Never switch in bytes that were not checked again (edge/ota/recheck.py), through the real CLI:
a version already on disk installed again, a rollback and `recover --boot` check the version they
make current against its signed manifest first; a damaged file is rewritten from an intact copy
(the store, or the bundle being installed), and where there is none the switch is refused, naming
the file, with the OTA state unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kit.ota import MODEL_CFG, build_version, damage, device, edge_ota, tree

V11 = MODEL_CFG + "# 1.1\n"


@pytest.fixture()
def dev(tmp_path: Path):
    return device(tmp_path, model_bytes=64 << 10, keep=3)


def ota_ok(dev, *args: str) -> dict:
    r = edge_ota(dev, *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def committed(dev, bundle: Path, *extra: str) -> dict:
    answer = ota_ok(dev, "install", str(bundle), "--pubkey", str(dev["pub"]), "--no-activate", *extra)
    assert ota_ok(dev, "commit")["result"] == "committed"
    return answer


def object_of(dev) -> Path:
    (obj,) = dev["ota"].store.objects.iterdir()
    return obj


def verify_problems(dev) -> str:
    r = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
    assert r.returncode in (0, 65) and "Traceback" not in r.stderr, r.stderr
    return "" if r.returncode == 0 else r.stderr


def test_the_audits_case_a_damaged_version_on_disk_is_repaired_before_it_is_switched_in(dev) -> None:
    """Two versions share a model; its object loses a bit; a newer full bundle writes a fresh
    object; the earlier valid bundle pushed again (--allow-downgrade) must not switch in the
    damaged bytes its version directory still links."""
    first = build_version(dev, "1.1.0", config=V11)
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, first)
    damage(object_of(dev))
    assert committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))["written_bytes"] == 64 << 10
    answer = committed(dev, first, "--allow-downgrade")
    assert answer["staged"] == "already on disk (same content)"
    checked = answer["checked"]
    assert checked["files"] == 1 and checked["bytes"] == 64 << 10 and checked["seconds"] >= 0
    assert checked["signature"] == f"the bundle's, verified with {dev['pub']}"
    assert len(checked["repaired"]) == 1 and checked["repaired"][0].startswith("models/m.gguf (was 65536 bytes, sha256")
    assert "rewritten from an intact copy on this device" in checked["repaired"][0]
    current = dev["ota"].root / "current" / "models" / "m.gguf"
    assert current.read_bytes() == dev["model"].read_bytes()
    problems = verify_problems(dev)
    assert "versions/1.0.0/models/m.gguf" in problems  # not switched in: left as it was, and named
    assert "versions/1.1.0" not in problems and "versions/2.0.0" not in problems


def test_a_damaged_file_with_no_intact_copy_is_rewritten_from_the_bundle(dev) -> None:
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, build_version(dev, "1.1.0", config=V11))
    damage(object_of(dev))  # both versions' links: no intact copy anywhere on the device
    answer = committed(dev, build_version(dev, "1.0.0"), "--allow-downgrade")
    assert f"rewritten from {dev['dir'] / '1.0.0.edgeb'}" in answer["checked"]["repaired"][0]
    assert (dev["ota"].root / "current" / "models" / "m.gguf").read_bytes() == dev["model"].read_bytes()
    problems = verify_problems(dev)
    assert "versions/1.1.0/models/m.gguf" in problems and "versions/1.0.0" not in problems


def test_a_thin_bundle_cannot_repair_and_the_switch_is_refused_naming_the_file(dev) -> None:
    from edge.ota.manifest import read_base

    full = build_version(dev, "1.0.0")
    committed(dev, full)
    committed(dev, build_version(dev, "1.1.0", config=V11))
    damage(object_of(dev))
    thin = build_version(dev, "1.0.0", base=read_base(full))  # carries nothing
    before = tree(dev["ota"])
    r = edge_ota(dev, "install", str(thin), "--pubkey", str(dev["pub"]), "--no-activate", "--allow-downgrade")
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert "models/m.gguf" in r.stderr and tree(dev["ota"]) == before


def _two_models(dev) -> None:
    """1.0.0 and 2.0.0 committed, each with its own model (not shared): 1.0.0's has one object."""
    other = dev["dir"] / "other.gguf"
    other.write_bytes(os.urandom(64 << 10))
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, build_version(dev, "2.0.0", model=other))


def _object_of_version(dev, version: str) -> Path:
    sha = json.loads((dev["ota"].versions / version / "manifest.json").read_text())["files"][0]["sha256"]
    return dev["ota"].store.object(sha)


def test_a_rollback_onto_a_damaged_version_is_refused_naming_the_file(dev) -> None:
    _two_models(dev)
    damage(_object_of_version(dev, "1.0.0"))
    before = tree(dev["ota"])
    r = edge_ota(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert "versions/1.0.0/models/m.gguf is damaged" in r.stderr and "refused" in r.stderr
    assert tree(dev["ota"]) == before and dev["ota"].link_target("current") == "2.0.0"
    # the way out the message names: the version's full bundle again, which rewrites the file
    answer = committed(dev, build_version(dev, "1.0.0"), "--allow-downgrade")
    assert answer["checked"]["repaired"] and verify_problems(dev) == ""


def test_a_rollback_checks_the_manifest_signature_and_repairs_from_the_store(dev) -> None:
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, build_version(dev, "1.1.0", config=V11))
    damage(object_of(dev))
    committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))  # a fresh object
    manifest = dev["ota"].versions / "1.1.0" / "manifest.json"
    signed = manifest.read_bytes()
    manifest.write_bytes(signed.replace(b"# 1.1", b"# 1.X"))
    r = edge_ota(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))
    assert r.returncode == 65 and "versions/1.1.0/manifest.json: does not verify with" in r.stderr, r.stderr
    manifest.write_bytes(signed)
    answer = ota_ok(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))
    assert answer["result"] == "rolled back" and answer["version"] == "1.1.0"
    assert answer["checked"]["signature"] == f"verified with {dev['pub']}"
    assert "rewritten from an intact copy on this device" in answer["checked"]["repaired"][0]
    assert "versions/1.1.0" not in verify_problems(dev)


def test_recover_boot_checks_the_version_it_goes_back_to(dev) -> None:
    committed(dev, build_version(dev, "1.0.0"))
    other = dev["dir"] / "other.gguf"
    other.write_bytes(os.urandom(64 << 10))
    ota_ok(dev, "install", str(build_version(dev, "2.0.0", model=other)), "--pubkey", str(dev["pub"]),
           "--no-activate")  # pending: a reboot rolls it back to 1.0.0
    damage(_object_of_version(dev, "1.0.0"))
    before = tree(dev["ota"])
    r = edge_ota(dev, "recover", "--boot")
    assert r.returncode == 65 and "versions/1.0.0/models/m.gguf is damaged" in r.stderr, r.stderr
    assert "2.0.0 cannot be rolled back" in r.stderr and tree(dev["ota"]) == before
    st = json.loads(edge_ota(dev, "status").stdout)
    assert st["pending"]["version"] == "2.0.0" and st["current"] == "1.0.0"
