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

from kit.ota import MODEL_CFG, build_version, damage, device, edge_ota, healthy_url, tree

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


# -- the bundle that made a version repairs it, whatever the state (issue 45) --------------------
def _push_again(dev, bundle: Path, restarts: Path, url: str) -> dict:
    """The bundle installed again, activated by a restart command that counts its runs."""
    return ota_ok(dev, "install", str(bundle), "--pubkey", str(dev["pub"]), "--restart-cmd",
                  f"echo restart >> {restarts}", "--health-url", url, "--timeout", "30")


def test_the_current_versions_own_bundle_repairs_it_in_place_and_activates_it_again(dev) -> None:
    bundle = build_version(dev, "1.0.0")
    committed(dev, bundle)
    url, server = healthy_url()
    restarts = dev["dir"] / "restarts.log"
    try:
        clean = _push_again(dev, bundle, restarts, url)
        assert clean["result"] == "already-current" and "repaired" not in clean["checked"]
        assert not restarts.exists()  # nothing changed: nothing activated again
        damage(object_of(dev))
        assert "versions/1.0.0/models/m.gguf" in verify_problems(dev)
        served = dev["ota"].root / "current" / "models" / "m.gguf"
        answer = _push_again(dev, bundle, restarts, url)
    finally:
        server.shutdown()
    assert answer["result"] == "repaired" and answer["version"] == "1.0.0", answer
    assert answer["checked"]["repaired"][0].startswith("models/m.gguf (was 65536 bytes")
    assert f"rewritten from {bundle}" in answer["checked"]["repaired"][0]
    assert served.read_bytes() == dev["model"].read_bytes() and verify_problems(dev) == ""
    assert restarts.read_text().splitlines() == ["restart"]  # a served file changed: activated once
    st = json.loads(edge_ota(dev, "status").stdout)
    assert st["current"] == "1.0.0" and st["history"][-1]["event"] == "repaired"


@pytest.mark.parametrize("harm", ["one hash digit", "no signature, another config"])
def test_a_damaged_manifest_never_locks_out_the_versions_own_signed_bundle(dev, harm: str) -> None:
    bundle = build_version(dev, "1.0.0")
    committed(dev, bundle)
    vdir = dev["ota"].versions / "1.0.0"
    manifest = json.loads((vdir / "manifest.json").read_text())
    if harm == "one hash digit":
        sha = manifest["files"][0]["sha256"]
        manifest["files"][0]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]
    else:
        (vdir / "manifest.sig").unlink()
        manifest["config"] += "# changed\n"
    (vdir / "manifest.json").write_text(json.dumps(manifest))  # still valid JSON
    assert "versions/1.0.0/manifest.json" in verify_problems(dev)
    answer = ota_ok(dev, "install", str(bundle), "--pubkey", str(dev["pub"]), "--no-activate")
    assert answer["result"] == "repaired"
    assert "manifest.json and manifest.sig (from the bundle: its signed manifest)" in answer["checked"]["repaired"]
    assert (vdir / "manifest.sig").read_bytes() == open_sig(bundle) and verify_problems(dev) == ""


def open_sig(bundle: Path) -> bytes:
    import tarfile

    with tarfile.open(bundle) as tar:
        return tar.extractfile("manifest.sig").read()  # type: ignore[union-attr]


def test_a_repairing_reinstall_of_an_earlier_version_rewrites_its_signature_so_a_rollback_takes_it(dev) -> None:
    first = build_version(dev, "1.0.0")
    committed(dev, first)
    committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))
    vdir = dev["ota"].versions / "1.0.0"
    (vdir / "manifest.sig").write_bytes(b"\0" * 64)  # damaged: the manifest no longer verifies
    r = edge_ota(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))
    assert r.returncode == 65 and "versions/1.0.0/manifest.json: does not verify" in r.stderr, r.stderr
    answer = committed(dev, first, "--allow-downgrade")  # the fix docs/ota.md names
    assert "manifest.json and manifest.sig (from the bundle: its signed manifest)" in answer["checked"]["repaired"]
    assert verify_problems(dev) == ""
    committed(dev, build_version(dev, "3.0.0", config=MODEL_CFG + "# 3\n"))
    assert ota_ok(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))["version"] == "1.0.0"


def test_an_unsigned_version_never_verifies_clean_until_its_bundle_signs_it(dev) -> None:
    first = build_version(dev, "1.0.0")
    committed(dev, first)
    vdir = dev["ota"].versions / "1.0.0"
    (vdir / "manifest.sig").unlink()  # and the rest rewritten consistently: an unsigned version
    manifest = json.loads((vdir / "manifest.json").read_text())
    manifest["config"] += "# unsigned\n"
    (vdir / "manifest.json").write_text(json.dumps(manifest))
    (vdir / "edge.toml").write_text(manifest["config"])
    assert "versions/1.0.0/manifest.json: no manifest.sig" in verify_problems(dev)
    ota_ok(dev, "install", str(build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n")), "--pubkey",
           str(dev["pub"]), "--no-activate")  # pending: a reboot would roll back onto 1.0.0
    for args in (("rollback", "--no-activate"), ("recover", "--boot")):
        before = tree(dev["ota"])
        r = edge_ota(dev, *args, "--pubkey", str(dev["pub"]))
        assert r.returncode == 65 and "no manifest.sig" in r.stderr and tree(dev["ota"]) == before, r.stderr
    answer = ota_ok(dev, "install", str(first), "--pubkey", str(dev["pub"]), "--no-activate",
                    "--allow-downgrade")  # its bundle rolls 2.0.0 back onto 1.0.0, signed again
    assert answer["rolled_back_first"]["failed"] == "2.0.0" and answer["version"] == "1.0.0"
    assert verify_problems(dev) == "" and (vdir / "edge.toml").read_text() == MODEL_CFG


def test_a_repair_from_another_versions_copy_replaces_the_damaged_object_in_the_store(dev) -> None:
    committed(dev, build_version(dev, "1.0.0"))
    committed(dev, build_version(dev, "2.0.0", config=MODEL_CFG + "# 2\n"))
    own = dev["ota"].versions / "2.0.0" / "models" / "m.gguf"
    copy = own.with_name("copy")
    copy.write_bytes(own.read_bytes())  # 2.0.0 holds its own copy (as an older edge's version does)
    copy.replace(own)
    obj = object_of(dev)
    damage(obj)  # the object, and 1.0.0's link to it
    answer = ota_ok(dev, "rollback", "--no-activate", "--pubkey", str(dev["pub"]))
    assert "rewritten from an intact copy on this device" in answer["checked"]["repaired"][0]
    from edge.fsutil import sha256_file

    assert sha256_file(obj) == obj.name  # the store holds intact content again
    assert verify_problems(dev) == ""
    damage(obj)
    assert f"objects/sha256/{obj.name}: its bytes do not hash to its name" in verify_problems(dev)
