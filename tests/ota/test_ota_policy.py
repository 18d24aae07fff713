"""OTA against hostile or unlucky input: bad versions, bombs, missing files, downgrades, replays,
changed content (all refused, the current version untouched); kill -9 at every file-system
operation of an install and of a rollback (status = links = files afterwards); a service that
exits at once fails the health check at once, with its own error as the reason."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from edge.fsutil import sha256_file
from edge.ota.bundle import build_bundle, open_bundle
from edge.ota.errors import BundleError, PolicyError, VersionError
from edge.ota.install import LINKS, Ota
from edge.ota.version import parse_version
from kit import EDGE
from kit.ota import device, tmpfs, tree

CFG = '[[models]]\nname = "m"\npath = "models/m.gguf"\n'


@pytest.fixture()
def dev(tmp_path: Path):
    return device(tmp_path, model_bytes=4096, keep=2)


def bundle(dev, version: str, content: bytes | None = None, config: str = CFG) -> Path:
    model = dev["model"]
    if content is not None:
        model = dev["dir"] / f"m-{version}.gguf"
        model.write_bytes(content)
    out = dev["dir"] / f"{version}-{os.urandom(3).hex()}.edgeb"
    build_bundle(out, version=version, files=[(model, "models/m.gguf", "model", None)], config=config,
                 key=dev["key"])
    return out


def forge(dev, out: Path, manifest: dict, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A bundle signed with the fleet key but made without build_bundle's checks (an old or
    buggy build tool, or a stolen CI job): the device must refuse it on its own."""
    from cryptography.hazmat.primitives import serialization

    raw = json.dumps(manifest).encode()
    sig = serialization.load_pem_private_key(dev["key"].read_bytes(), None).sign(raw)
    with tarfile.open(out, "w") as tar:
        for name, data in (("manifest.json", raw), ("manifest.sig", sig)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data))
    return out


def manifest(version: str, files: list[dict], config: str = CFG) -> dict:
    return {"format": 1, "bundle_version": version, "min_edge_version": "0.1.0", "files": files,
            "config": config}


def model_entry(data: bytes, size: int | None = None) -> dict:
    import hashlib

    return {"path": "models/m.gguf", "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data) if size is None else size, "kind": "model", "key": None}


def edge_ota(dev, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, "ota", *args, "--config", str(dev["cfg"])], capture_output=True,
                          text=True, timeout=120)


def healthy() -> tuple[bool, str]:
    return True, ""


def install(dev, path: Path, **kw):
    return dev["ota"].install(open_bundle(path, dev["pub"]), healthy, **kw)


# -- versions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["", "../../x", "1.0", "v1.0.0", "1.0.0/..", "01.0.0", "1.0.0+b",
                                 "1.0.0-", "1.0.0-a..b", "1.0.0 ", ".", "1.0.0-" + "a" * 60,
                                 "1.0." + "1" * 61])
def test_version_grammar_refuses(bad) -> None:
    with pytest.raises(VersionError, match="expected MAJOR.MINOR.PATCH"):
        parse_version(bad)


def test_version_ordering() -> None:
    order = ["0.9.9", "1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta.2",
             "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.0.10", "1.2.0", "10.0.0"]
    parsed = [parse_version(v) for v in order]
    assert sorted(reversed(parsed)) == parsed and len(set(parsed)) == len(parsed)


def test_version_numbers_have_no_digit_cap_within_64_characters(dev) -> None:
    """SemVer caps no number: a date-stamped patch (10 digits) is a version, and orders as one."""
    assert parse_version("1.0.2026120301") > parse_version("1.0.999999999")
    assert parse_version("1.0.0-rc.20261203011") > parse_version("1.0.0-rc.9")
    assert parse_version("1." + "1" * 60 + ".0").text == "1." + "1" * 60 + ".0"  # 64 characters
    assert install(dev, bundle(dev, "1.0.2026120301"))["result"] == "committed"
    assert dev["ota"].link_target("current") == "1.0.2026120301"


def test_build_refuses_empty_and_path_like_versions(dev) -> None:
    for v in ("", "../../x"):
        with pytest.raises(VersionError):
            bundle(dev, v)
    r = subprocess.run([*EDGE, "ota", "build", "--version", "", "--key", str(dev["key"]), "--config",
                        str(dev["cfg"]), "-o", str(dev["dir"] / "x.edgeb")], capture_output=True, text=True)
    assert r.returncode == 2 and "'--version': version '' is empty" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(VersionError, match="min_edge_version 'v9.0.0' is not a version"):
        build_bundle(dev["dir"] / "y.edgeb", version="1.0.0", files=[], config=CFG, key=dev["key"],
                     min_edge_version="v9.0.0")


@pytest.mark.parametrize("version", ["", "../../victim", "..", "x/../../victim"])
def test_signed_bundle_with_hostile_version_is_refused(dev, version) -> None:
    install(dev, bundle(dev, "1.0.0"))
    victim = dev["dir"] / "state" / "victim"
    victim.mkdir()
    before = tree(dev["ota"])
    data = dev["model"].read_bytes()
    info = tarfile.TarInfo("files/models/m.gguf")
    info.size = len(data)
    evil = forge(dev, dev["dir"] / "evil.edgeb", manifest(version, [model_entry(data)]), [(info, data)])
    r = edge_ota(dev, "install", str(evil), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "bundle_version" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*EDGE, "ota", "inspect", str(evil), "--pubkey", str(dev["pub"])],
                       capture_output=True, text=True)
    assert r.returncode == 65 and "bundle_version" in r.stderr
    assert victim.is_dir() and tree(dev["ota"]) == before and dev["ota"].link_target("current") == "1.0.0"


def test_min_edge_version_is_parsed_not_guessed(dev) -> None:
    forged = forge(dev, dev["dir"] / "v9.edgeb", {**manifest("2.0.0", []), "min_edge_version": "v9.0.0"}, [])
    with pytest.raises(VersionError, match="min_edge_version 'v9.0.0' is not a version"):
        open_bundle(forged, dev["pub"])
    future = forge(dev, dev["dir"] / "f.edgeb", {**manifest("2.0.0", []), "min_edge_version": "9.0.0"}, [])
    with pytest.raises(BundleError, match="needs edge >= 9.0.0"):
        install(dev, future)


# -- bounded extraction -----------------------------------------------------------------------
@pytest.fixture()
def small_fs(tmp_path: Path):
    """A 2 MiB tmpfs for the OTA root: a bomb can at most fill it."""
    with tmpfs(tmp_path / "small", "2m") as mnt:
        yield mnt


def _sparse_bomb(dev, claimed: int) -> Path:
    """GNU tar sparse member: 10 KiB on the wire, 1 GiB once expanded."""
    work = dev["dir"] / "bomb"
    (work / "files" / "models").mkdir(parents=True)
    member = work / "files" / "models" / "m.gguf"
    with open(member, "wb") as f:
        f.truncate(1 << 30)
    raw = json.dumps(manifest("2.0.0", [model_entry(b"\0" * claimed)])).encode()
    (work / "manifest.json").write_bytes(raw)
    from cryptography.hazmat.primitives import serialization

    (work / "manifest.sig").write_bytes(serialization.load_pem_private_key(dev["key"].read_bytes(), None).sign(raw))
    out = dev["dir"] / "bomb.edgeb"
    subprocess.run(["tar", "-C", str(work), "--format=gnu", "--sparse", "--no-recursion", "-cf", str(out),
                    "manifest.json", "manifest.sig", "files/models/m.gguf"], check=True)
    assert out.stat().st_size < 64 << 10
    return out


def test_sparse_bomb_is_refused_before_a_byte_is_written(dev, small_fs) -> None:
    ota = Ota(small_fs / "ota")
    ota.install(open_bundle(bundle(dev, "1.0.0"), dev["pub"]), healthy)
    before, used = tree(ota), shutil.disk_usage(small_fs).used
    for claimed in (4096, 1 << 30):  # the manifest lies about the size / tells the truth
        bomb = _sparse_bomb(dev, claimed)
        with pytest.raises(BundleError, match="refusing sparse file entry|needs \\d+ bytes .* only \\d+ free"):
            ota.install(open_bundle(bomb, dev["pub"]), healthy)
        shutil.rmtree(dev["dir"] / "bomb")
        assert tree(ota) == before and shutil.disk_usage(small_fs).used == used
    r = subprocess.run([*EDGE, "ota", "inspect", str(bomb), "--pubkey", str(dev["pub"])], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 65 and "refusing sparse file entry" in r.stderr


def test_member_longer_than_declared_is_not_written(dev) -> None:
    install(dev, bundle(dev, "1.0.0"))
    before = tree(dev["ota"])
    data = os.urandom(8192)
    info = tarfile.TarInfo("files/models/m.gguf")
    info.size = len(data)
    lie = forge(dev, dev["dir"] / "lie.edgeb", manifest("2.0.0", [model_entry(data[:100])]), [(info, data)])
    with pytest.raises(BundleError, match="manifest says 100 bytes, the bundle's entry is 8192 bytes; nothing"):
        install(dev, lie)
    assert tree(dev["ota"]) == before


def test_directory_member_is_named_as_such(dev) -> None:
    d = tarfile.TarInfo("files/models")
    d.type = tarfile.DIRTYPE
    odd = forge(dev, dev["dir"] / "dir.edgeb", manifest("2.0.0", [], config=CFG.replace(
        "models/m.gguf", str(dev["model"]))), [(d, b"")])  # a model already on the device
    with pytest.raises(BundleError, match="refusing directory entry 'files/models'"):
        install(dev, odd)


# -- paths: one verdict, one exit code, in inspect and in install ----------------------------
def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _inspect_and_install(dev, path: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    inspect = subprocess.run([*EDGE, "ota", "inspect", str(path), "--pubkey", str(dev["pub"])],
                             capture_output=True, text=True, timeout=120)
    inst = edge_ota(dev, "install", str(path), "--pubkey", str(dev["pub"]), "--no-activate")
    return inspect, inst


LONG_PATHS = {
    "5,030-character path": "models/" + "/".join(["d" * 200] * 24) + "/" + "x" * 197,
    "1,500 levels deep": "/".join(["d"] * 1500) + "/m.gguf",
    "300-character component": "models/" + "n" * 300,
    "a reserved name": "edge.toml",
}


@pytest.mark.parametrize("what", LONG_PATHS)
def test_long_deep_and_reserved_paths_get_the_same_refusal_from_inspect_and_install(dev, what) -> None:
    install(dev, bundle(dev, "1.0.0"))
    before = tree(dev["ota"])
    data = os.urandom(512)
    rel = LONG_PATHS[what]
    entry = {**model_entry(data), "path": rel}
    cfg = CFG.replace("models/m.gguf", "/dev/null")  # the config names a device file: only the path matters
    evil = forge(dev, dev["dir"] / "long.edgeb", manifest("2.0.0", [entry], config=cfg),
                 [_member(f"files/{rel}", data)])
    inspect, inst = _inspect_and_install(dev, evil)
    words = {"5,030-character path": "bytes long, more than 1024", "1,500 levels deep": "levels deep, more than 32",
             "300-character component": "has a component of 300 bytes, longer than the 255 a file name may have",
             "a reserved name": "is a name the installer writes itself"}[what]
    for r in (inspect, inst):
        assert r.returncode == 65 and "Traceback" not in r.stderr and words in r.stderr, r.stderr[-800:]
        assert len(r.stderr) < 1000  # the hostile name is cut in the message
    assert tree(dev["ota"]) == before


def test_a_file_that_fails_its_hash_is_65_in_inspect_and_install(dev) -> None:
    data = os.urandom(512)
    bad = forge(dev, dev["dir"] / "bad.edgeb", manifest("2.0.0", [model_entry(data)]),
                [_member("files/models/m.gguf", data[:-1] + bytes([data[-1] ^ 1]))])
    inspect, inst = _inspect_and_install(dev, bad)
    assert inspect.returncode == inst.returncode == 65
    assert "do not match the manifest" in inspect.stderr and "fails its check" in inst.stderr


def test_a_bundle_of_the_current_version_with_tampered_bytes_is_refused(dev) -> None:
    good = bundle(dev, "1.0.0")
    install(dev, good)
    data = dev["model"].read_bytes()
    raw = open_bundle(good, dev["pub"]).raw_manifest
    from cryptography.hazmat.primitives import serialization

    sig = serialization.load_pem_private_key(dev["key"].read_bytes(), None).sign(raw)
    tampered = dev["dir"] / "tampered.edgeb"
    with tarfile.open(tampered, "w") as tar:  # the same signed manifest, other bytes
        for name, payload in (("manifest.json", raw), ("manifest.sig", sig),
                              ("files/models/m.gguf", data[:-1] + bytes([data[-1] ^ 1]))):
            tar.addfile(*_member(name, payload)[:1], io.BytesIO(payload))
    r = edge_ota(dev, "install", str(tampered), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "fail their check" in r.stderr and "1.0.0 is installed and stays" in r.stderr
    r = edge_ota(dev, "install", str(good), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "already-current"
    assert "match its signed manifest" in json.loads(r.stdout)["verified"]


# -- references -------------------------------------------------------------------------------
def test_bundle_missing_a_model_its_config_names_is_refused(dev) -> None:
    install(dev, bundle(dev, "1.0.0"))
    before = tree(dev["ota"])
    cfg = CFG + '[[models]]\nname = "big"\npath = "models/big.gguf"\n'
    r = edge_ota(dev, "install", str(bundle(dev, "2.0.0", config=cfg)), "--pubkey", str(dev["pub"]),
                 "--no-activate")
    assert r.returncode == 65 and "does not carry" in r.stderr and "model 'big': models/big.gguf" in r.stderr
    assert tree(dev["ota"]) == before


# -- policy -----------------------------------------------------------------------------------
def test_downgrade_refused_unless_allowed(dev) -> None:
    old, new = bundle(dev, "1.0.0"), bundle(dev, "2.0.0", b"new")
    install(dev, new)
    before = tree(dev["ota"])
    r = edge_ota(dev, "install", str(old), "--pubkey", str(dev["pub"]), "--no-activate")
    assert r.returncode == 65 and "1.0.0 is older than 2.0.0" in r.stderr and "--allow-downgrade" in r.stderr
    assert tree(dev["ota"]) == before
    assert install(dev, old, allow_downgrade=True)["result"] == "committed"
    assert dev["ota"].state()["highest"] == "2.0.0"  # monotonic: a downgrade does not lower it


def test_replay_of_an_old_bundle_is_refused_after_rollback_and_pruning(dev) -> None:
    ota = dev["ota"]
    first = bundle(dev, "1.0.0")
    for i, b in enumerate([first, bundle(dev, "2.0.0", b"2"), bundle(dev, "3.0.0", b"3")]):
        install(dev, b)
    assert not (ota.versions / "1.0.0").exists()  # pruned (keep 2)
    ota.rollback(healthy)  # operator: back to 2.0.0
    assert ota.state()["current"] == "2.0.0" and ota.state()["highest"] == "3.0.0"
    with pytest.raises(PolicyError, match="older than 3.0.0"):
        install(dev, first)
    assert ota.link_target("current") == "2.0.0"


def test_same_version_with_new_content_is_refused(dev) -> None:
    ota = dev["ota"]
    install(dev, bundle(dev, "1.0.0"))
    before = tree(ota)
    with pytest.raises(PolicyError, match="1.0.0 was installed on this device before with other content"):
        install(dev, bundle(dev, "1.0.0", b"other weights"))
    assert tree(ota) == before
    for v in ("2.0.0", "3.0.0"):
        install(dev, bundle(dev, v, v.encode()))
    assert not (ota.versions / "1.0.0").exists()  # pruned: the state's record still knows it
    with pytest.raises(PolicyError, match="before with other content"):
        install(dev, bundle(dev, "1.0.0", b"other weights"), allow_downgrade=True)
    rebuilt = bundle(dev, "3.0.0", b"3.0.0")  # same content built again: not a change
    assert install(dev, rebuilt)["result"] == "already-current"


# -- kill -9 at every file-system operation ---------------------------------------------------
def _forked_install(root: Path, path: Path, pub: Path, ok: bool, env: dict[str, str]) -> int:
    pid = os.fork()
    if pid == 0:  # the child installs and dies where it is told (EDGE_OTA_KILL_AT_OP)
        code = 1
        try:
            os.environ.update(env)
            def activate() -> tuple[bool, str]:  # with ok False, only the new version is unhealthy
                good = ok or os.readlink(root / "current") != "versions/2.0.0"
                return good, "" if good else "sick"

            Ota(root, keep=2).install(open_bundle(path, pub), activate)
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _consistent(ota: Ota, expect: set[str]) -> str:
    """status = links = files: state.json, the links and the version dirs agree; no leftovers."""
    st = ota.status()
    assert st["pending"] is None and st["links"] == {k: st[k] for k in LINKS}
    assert st["current"] in expect
    assert sorted(p.name for p in ota.versions.iterdir()) == st["on_disk"]  # nothing incomplete
    assert {st["current"], st["previous"]} - {None} <= set(st["on_disk"]) and len(st["on_disk"]) <= 2
    assert not [p for p in ota.root.iterdir() if p.name.endswith((".lnk", ".tmp"))]
    cur = ota.root / "current"
    for f in json.loads((cur / "manifest.json").read_text())["files"]:
        assert sha256_file(cur / f["path"]) == f["sha256"]
    assert (cur / "edge.toml").is_file()
    used = {f["sha256"] for d in ota.versions.iterdir() for f in json.loads((d / "manifest.json").read_text())["files"]}
    assert {p.name for p in ota.store.objects.iterdir()} == used  # no object lost, none left over
    return st["current"]


@pytest.mark.parametrize("ok", [True, False], ids=["commit", "rollback"])
def test_kill_at_every_fs_operation_converges(dev, ok) -> None:
    template = dev["dir"] / "template"
    for v in ("0.9.0", "1.0.0"):  # a previous and a current: the install prunes one
        Ota(template, keep=2).install(open_bundle(bundle(dev, v, v.encode()), dev["pub"]), healthy)
    new = bundle(dev, "2.0.0", b"new weights")
    log = dev["dir"] / "ops.log"
    work = dev["dir"] / "work"
    shutil.copytree(template, work, symlinks=True)
    assert _forked_install(work, new, dev["pub"], ok, {"EDGE_OTA_FS_LOG": str(log)}) == 0
    ops = log.read_text().splitlines()
    assert len(ops) > 20 and any(" exchange " in o and "state.json" in o for o in ops)
    final = "2.0.0" if ok else "1.0.0"
    outcomes = set()
    for n in range(1, len(ops) + 1):
        shutil.rmtree(work)
        shutil.copytree(template, work, symlinks=True)
        assert _forked_install(work, new, dev["pub"], ok, {"EDGE_OTA_KILL_AT_OP": str(n)}) == 137, ops[n - 1]
        ota = Ota(work, keep=2)
        assert ota.link_target("current") in ("1.0.0", "2.0.0")  # never a missing or half version
        assert (work / "current" / "edge.toml").is_file(), ops[n - 1]
        ota.recover(None)  # at boot
        outcomes.add(_consistent(ota, {"1.0.0", final}))
        assert _forked_install(work, new, dev["pub"], ok, {}) == 0
        assert _consistent(Ota(work, keep=2), {final}) == final, ops[n - 1]
    assert outcomes == ({"1.0.0", "2.0.0"} if ok else {"1.0.0"})


# -- health check -----------------------------------------------------------------------------
def test_a_service_that_exits_fails_the_health_check_at_once_with_its_error(dev) -> None:
    install(dev, bundle(dev, "1.0.0"))
    broken = bundle(dev, "2.0.0", b"this is not a GGUF file")
    pid_file, log = dev["dir"] / "serve.pid", dev["dir"] / "serve.log"
    current = dev["ota"].root / "current" / "edge.toml"
    restart = f"{' '.join(EDGE)} serve --config {current} >{log} 2>&1 & echo $! >{pid_file}"
    t0 = time.monotonic()
    r = edge_ota(dev, "install", str(broken), "--pubkey", str(dev["pub"]), "--restart-cmd", restart,
                 "--health-url", "http://127.0.0.1:9/readyz", "--timeout", "300",
                 "--pid-file", str(pid_file), "--log-file", str(log))
    took = time.monotonic() - t0
    # 1.0.0's model is random bytes too: the rollback's restart exits as well, and says so (exit
    # 1 as every rollback: the bundle itself was fine)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "2.0.0 rolled back (health check failed: the service (pid" in r.stderr  # its own words follow:
    assert "versions/2.0.0/models/m.gguf: not a GGUF file" in r.stderr
    assert ") to 1.0.0, which is not healthy either" in r.stderr
    assert took < 150  # noticed at once, not after the 300 s timeout (twice)
    assert dev["ota"].link_target("current") == "1.0.0"


def test_a_restart_that_leaves_a_background_child_is_not_a_hang(dev) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    from edge.ota.activate import command_activator

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/readyz"
        ok, why = command_activator("sleep 20 & echo started", url, timeout=10).activate()
        assert ok, why
    finally:
        srv.shutdown()
