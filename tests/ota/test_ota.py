"""OTA: real signed bundles; refusals; health check and rollback with a real service; update under
load. Hostile bundles, policy and the kill-at-every-file-system-operation test: test_ota_policy.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from edge.ota.bundle import BundleError, build_bundle, keygen, open_bundle
from edge.ota.install import Ota
from kit import EDGE, PidOne, post
from kit.ota import A, B, cfg_text, committed, edge_ota, install, tmpfs  # fixtures `kit`, `live`: kit/ota.py


@contextlib.contextmanager
def _clients(address: tuple[str, int], req: dict, n: int):
    """n clients asking `req` in a loop until the block ends: (answers per client, errors)."""
    seen: list[list[str]] = [[] for _ in range(n)]
    errors: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                status, body = post(address, "/v1/completions", req, timeout=120)
            except OSError as exc:
                errors.append(repr(exc))
                continue
            if status != 200:
                errors.append(f"HTTP {status}")
            else:
                seen[i].append(body["choices"][0]["text"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        yield seen, errors
    finally:
        stop.set()
        for t in threads:
            t.join()


def _one_way(seen: list[list[str]], text_a: str, text_b: str) -> None:
    """Per client: A's answers, then B's, never back, and nothing else."""
    for answers in seen:
        assert set(answers) <= {text_a, text_b}
        if text_b in answers:
            assert text_a not in answers[answers.index(text_b):]


def test_install_commit_status(kit) -> None:
    r = install(kit, "A", "--no-activate")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"] == "switched"
    assert json.loads(edge_ota(kit, "commit").stdout)["result"] == "committed"
    ota = kit["ota"]
    assert ota.link_target("current") == A and (ota.root / "current" / "models" / "a.gguf").is_file()
    assert (ota.root / "current" / "edge.toml").read_text() == cfg_text("a.gguf")
    st = json.loads(edge_ota(kit, "status").stdout)
    assert st["current"] == A and st["pending"] is None and [h["event"] for h in st["history"]] == ["staged", "committed"]
    assert st["highest"] == A and st["links"] == {"current": A, "previous": None} and st["on_disk"] == [A]
    assert edge_ota(kit, "status", "--field", "current").stdout.strip() == A
    r = edge_ota(kit, "commit")
    assert r.returncode != 0 and "nothing to commit" in r.stderr


def _rewrite(src: Path, dst: Path, change) -> Path:
    """Copy a bundle member by member, letting `change(info, data)` alter or add members."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin:
            data = tin.extractfile(m).read() if m.isfile() else b""
            for info, payload in change(m, data):
                tout.addfile(info, io.BytesIO(payload) if info.isfile() else None)
    return dst


def _same(m, data):
    m.size = len(data)
    return [(m, data)]


def tamper_manifest(m, data):
    if m.name == "manifest.json":
        data = data.replace(b'"bundle_version": "2.0.0"', b'"bundle_version": "3.0.0"')
    return _same(m, data)


def tamper_file(m, data):
    if m.name.startswith("files/"):
        data = data[:-1] + bytes([data[-1] ^ 1])
    return _same(m, data)


def add_traversal(m, data):
    out = _same(m, data)
    if m.name.startswith("files/"):
        evil = tarfile.TarInfo("files/../../evil.sh")
        evil.size = 4
        out.append((evil, b"boom"))
    return out


def add_symlink(m, data):
    out = _same(m, data)
    if m.name.startswith("files/"):
        link = tarfile.TarInfo("files/models/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
        out.append((link, b""))
    return out


@pytest.mark.parametrize("change, words", [
    (tamper_manifest, "signature does not verify"),
    (tamper_file, "fails its check"),
    (add_traversal, "refusing entry 'files/../../evil.sh'"),
    (add_symlink, "refusing symlink entry 'files/models/link'"),
])
def test_bad_bundles_are_refused_and_current_stays(kit, change, words) -> None:
    committed(kit, "A")
    bad = _rewrite(kit["bundles"]["B"], kit["dir"] / "bad.edgeb", change)
    r = edge_ota(kit, "install", str(bad), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 65 and words in r.stderr and "Traceback" not in r.stderr
    ota = kit["ota"]
    assert ota.link_target("current") == A
    assert not list(ota.versions.glob(".staging-*")) and not (ota.versions / B).exists()
    assert not (kit["dir"] / "evil.sh").exists() and not (kit["dir"] / "state" / "evil.sh").exists()


def test_wrong_key_unsigned_and_truncated(kit) -> None:
    other = kit["dir"] / "other.key"
    other_pub = keygen(other)
    r = edge_ota(kit, "install", str(kit["bundles"]["A"]), "--pubkey", str(other_pub))
    assert r.returncode == 65 and "signature does not verify" in r.stderr
    with pytest.raises(BundleError, match="refusing an unverified bundle"):
        open_bundle(kit["bundles"]["A"], None)
    assert open_bundle(kit["bundles"]["A"], None, insecure=True).version == A
    data = kit["bundles"]["B"].read_bytes()
    cut = kit["dir"] / "cut.edgeb"
    cut.write_bytes(data[: len(data) - 200_000])
    committed(kit, "A")
    r = edge_ota(kit, "install", str(cut), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 65 and "truncated" in r.stderr
    assert kit["ota"].link_target("current") == A
    sig_at = data.index(b"manifest.sig") + 512  # the signature's data block follows its header
    cut.write_bytes(data[: sig_at + 20])  # cut inside manifest.sig
    r = edge_ota(kit, "install", str(cut), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 65 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_bundle_without_an_engine_for_this_device_names_the_key(kit) -> None:
    bundle = kit["dir"] / "E.edgeb"
    build_bundle(bundle, version="5.0.0", files=[], key=kit["key"],
                 config='[[engines]]\nname = "det"\nbackend = "onnxruntime"\nonnx_sha256 = "' + "ab" * 32 +
                        '"\nprecision = "fp32"\nstore = "engines"\n')
    r = edge_ota(kit, "install", str(bundle), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 65 and "no engine for this device's key: det needs cpu-" in r.stderr


def _converged(kit, version: str) -> None:
    ota = kit["ota"]
    st = ota.state()
    assert ota.link_target("current") == version and st["current"] == version and st["pending"] is None
    assert (ota.versions / version / ".complete").is_file()
    assert not list(ota.versions.glob(".staging-*"))


def test_failed_health_check_rolls_back_with_the_service_error(kit, live) -> None:
    health = f"http://{live.address[0]}:{live.address[1]}/readyz"
    # a restart that fails while `current` is B (as a service that cannot start B would)
    only_a = f'test "$(readlink {kit["ota"].root / "current"})" = versions/{A} || {{ echo B will not start >&2; exit 3; }}'
    args = ("--restart-cmd", only_a, "--health-url", health, "--timeout", "30")
    r = install(kit, "B", *args)
    assert r.returncode == 1 and json.loads(r.stdout)["result"] == "rolled back"
    _converged(kit, A)
    assert kit["ota"].state()["history"][-1]["event"] == "rolled back"
    assert "B will not start" in kit["ota"].state()["history"][-1]["reason"]
    r = edge_ota(kit, "recover", *args)  # nothing pending: recover changes nothing
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "nothing pending", r.stderr
    _converged(kit, A)


def test_retention_after_every_commit_and_rollback(kit) -> None:
    ota = Ota(kit["ota"].root, keep=2)
    for i, healthy in enumerate((True, True, True, False, False), start=1):
        b = kit["dir"] / f"V{i}.edgeb"
        build_bundle(b, version=f"{i}.0.0", files=[(kit["a"], "models/a.gguf", "model", None)],
                     config=cfg_text("a.gguf"), key=kit["key"])
        new = f"versions/{i}.0.0"  # unhealthy: only the new version, and only when `healthy` is False
        ota.install(open_bundle(b, kit["pub"]), activate=lambda ok=healthy, new=new: (
            ok or os.readlink(ota.root / "current") != new, "sick"))
        assert len(list(ota.versions.iterdir())) <= 2  # after each commit and each rollback
    assert sorted(d.name for d in ota.versions.iterdir()) == ["2.0.0", "3.0.0"]
    assert ota.link_target("current") == "3.0.0" and ota.link_target("previous") == "2.0.0"
    assert [h["event"] for h in ota.state()["history"][-2:]] == ["staged", "rolled back"]


def test_disk_full_during_extract_is_clear_and_harmless(kit, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "300k") as small:
        ota = Ota(small / "ota")
        with pytest.raises(BundleError, match=r"needs \d+ bytes on .*, only \d+ free; nothing was written"):
            ota.install(open_bundle(kit["bundles"]["A"], kit["pub"]), activate=None)
        assert not ota.root.exists()  # a refusal on a fresh device leaves nothing, not even the lock


def test_update_under_load_then_a_failing_bundle_rolls_back(kit, live) -> None:
    ota = kit["ota"]
    req = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    _, first = post(live.address, "/v1/completions", req)
    text_a = first["choices"][0]["text"]

    def restart() -> tuple[bool, str]:  # what systemctl restart does for the harness' service
        live.stop()
        live.start()
        try:
            live.wait_for("READY", "1", timeout=60)
            return True, ""
        except (RuntimeError, TimeoutError) as exc:
            return False, str(exc)[-300:]

    with _clients(live.address, req, 4) as (seen, errors):
        result = ota.install(open_bundle(kit["bundles"]["B"], kit["pub"]), activate=restart)
        assert result["result"] == "committed"
        _, now = post(live.address, "/v1/completions", req)
        text_b = now["choices"][0]["text"]
        assert text_b != text_a  # another model is answering
        bad = kit["dir"] / "C.edgeb"  # a model that loads, but whose warm-up prompt cannot fit its context
        build_bundle(bad, version="3.0.0", files=[(kit["a"], "models/a.gguf", "model", None)], key=kit["key"],
                     config=cfg_text("a.gguf", 'prompts = ["' + "word " * 300 + '"]\n'))
        result = ota.install(open_bundle(bad, kit["pub"]), activate=restart)
        assert result["result"] == "rolled back" and "warmup.prompts[0]" in live.log_tail(20000)
        _, after = post(live.address, "/v1/completions", req)
        assert after["choices"][0]["text"] == text_b  # B kept serving
    assert errors == []
    _one_way(seen, text_a, text_b)
    # every client was served across the update, and B answered after the switch (counts, not
    # throughput: this runs on loaded CI machines)
    assert all(seen) and any(text_b in answers for answers in seen)


def test_inspect_verifies_signature_and_every_file(kit) -> None:
    def inspect(bundle: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*EDGE, "ota", "inspect", str(bundle), "--pubkey", str(kit["pub"])],
                              capture_output=True, text=True, timeout=60)

    ok = inspect(kit["bundles"]["B"])
    assert ok.returncode == 0 and "signature verified" in ok.stdout and "ok  model" in ok.stdout
    assert 'path = "models/b.gguf"' in ok.stdout
    bad = _rewrite(kit["bundles"]["B"], kit["dir"] / "bad.edgeb", tamper_file)
    r = inspect(bad)
    assert r.returncode != 0 and "BAD model" in r.stdout and "do not match the manifest" in r.stderr


def test_a_restart_that_hangs_counts_as_unhealthy(kit) -> None:
    from edge.ota.activate import command_activator

    ok, why = command_activator("sleep 5", "http://127.0.0.1:9/readyz", timeout=0.5).activate()
    assert not ok and "did not finish within" in why
    ok, why = command_activator("exit 4", "http://127.0.0.1:9/readyz", timeout=5).activate()
    assert not ok and "exited 4" in why


def test_activation_by_reload_has_no_gap_and_a_failing_version_never_serves(kit) -> None:
    """[ota] activation = "reload": the running process loads and warms the new version beside
    the old one; clients never wait on a restart, and a version whose warm-up fails is never
    served (the rollback is one more reload, the same process throughout)."""
    from edge.ota.activate import ReloadActivator

    ota, svc_state = kit["ota"], kit["dir"] / "svc-state"
    paths = f'[paths]\nstate_dir = "{svc_state}"\n'
    bundles = {}
    for v, m in (("1.0.0", kit["a"]), ("2.0.0", kit["b"])):
        bundles[v] = kit["dir"] / f"r{v}.edgeb"
        build_bundle(bundles[v], version=v, files=[(m, f"models/{m.name}", "model", None)],
                     config=cfg_text(m.name, paths), key=kit["key"])
    bad = kit["dir"] / "r3.edgeb"  # loads, but its warm-up prompt cannot fit its context
    build_bundle(bad, version="3.0.0", files=[(kit["a"], "models/a.gguf", "model", None)], key=kit["key"],
                 config=cfg_text("a.gguf", 'prompts = ["' + "word " * 300 + '"]\n' + paths))
    assert ota.install(open_bundle(bundles["1.0.0"], kit["pub"]), activate=None)["result"] == "switched"
    ota.commit()
    current = ota.root / "current" / "edge.toml"
    activator = ReloadActivator(current, [(svc_state / "control.sock", "the service's state_dir")], timeout=120)
    req = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    with PidOne([*EDGE, "serve", "--config", str(current)]) as live:
        live.start()
        live.wait_for("READY", "1")
        pid = live.proc.pid
        text_a = post(live.address, "/v1/completions", req)[1]["choices"][0]["text"]
        with _clients(live.address, req, 3) as (seen, errors):
            assert ota.install(open_bundle(bundles["2.0.0"], kit["pub"]), activate=activator)["result"] == "committed"
            text_b = post(live.address, "/v1/completions", req)[1]["choices"][0]["text"]
            result = ota.install(open_bundle(bad, kit["pub"]), activate=activator)
            assert result["result"] == "rolled back"
            assert "warmup.prompts[0]" in json.dumps(ota.state()["history"][-1])
            assert post(live.address, "/v1/completions", req)[1]["choices"][0]["text"] == text_b
        assert live.proc.pid == pid and live.proc.poll() is None  # never restarted
    assert text_b != text_a and errors == []
    _one_way(seen, text_a, text_b)  # never the failing version's


def _reload_bundles(kit, paths: str) -> dict[str, Path]:
    """1.0.0 and a config-only 1.1.0 (same model file, another [server] setting)."""
    out = {}
    for v, extra in (("1.0.0", ""), ("1.1.0", "[server]\nmax_queue = 9\n")):
        out[v] = kit["dir"] / f"cfg-only-{v}.edgeb"
        build_bundle(out[v], version=v, files=[(kit["a"], "models/a.gguf", "model", None)],
                     config=cfg_text("a.gguf", paths + extra), key=kit["key"])
    return out


@contextlib.contextmanager
def _serving_current(kit, bundle: Path):
    r = edge_ota(kit, "install", str(bundle), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr
    assert edge_ota(kit, "commit").returncode == 0
    with PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")]) as live:
        live.start()
        live.wait_for("READY", "1")
        yield live


def test_install_reload_finds_the_control_socket_of_a_service_with_another_state_dir(kit) -> None:
    """The service's state_dir comes from the config it serves, not from the installer's."""
    svc_state = kit["dir"] / "svc-state"
    bundles = _reload_bundles(kit, f'[paths]\nstate_dir = "{svc_state}"\n')
    with _serving_current(kit, bundles["1.0.0"]) as live:
        pid = live.proc.pid
        r = edge_ota(kit, "install", str(bundles["1.1.0"]), "--pubkey", str(kit["pub"]), "--reload", "--timeout", "120")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["result"] == "committed" and out["version"] == "1.1.0" and "reload" in out
        assert live.proc.pid == pid and live.proc.poll() is None
    assert [h["event"] for h in kit["ota"].state()["history"]][-1] == "committed"


def test_the_current_versions_bundle_repairs_a_bit_flip_and_the_reload_loads_the_intact_model(kit) -> None:
    """The served model loses a bit; its own bundle pushed again with --reload: the file is
    rewritten (a new inode) and the same process loads it, not the damaged one (issue 45)."""
    from kit.ota import damage

    bundles = _reload_bundles(kit, f'[paths]\nstate_dir = "{kit["dir"] / "state"}"\n')
    with _serving_current(kit, bundles["1.0.0"]) as live:
        pid = live.proc.pid
        served = kit["ota"].root / "current" / "models" / "a.gguf"
        before = os.stat(served).st_ino
        damage(served)
        assert edge_ota(kit, "verify", "--pubkey", str(kit["pub"])).returncode == 65
        r = edge_ota(kit, "install", str(bundles["1.0.0"]), "--pubkey", str(kit["pub"]), "--reload", "--timeout", "120")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["result"] == "repaired" and out["checked"]["repaired"][0].startswith("models/a.gguf (was")
        assert out["reload"]["loaded"] == ["m"] and out["reload"]["kept"] == []  # the new bytes, loaded
        assert live.proc.pid == pid and live.proc.poll() is None and os.stat(served).st_ino != before
        assert served.read_bytes() == kit["a"].read_bytes()
    assert edge_ota(kit, "verify", "--pubkey", str(kit["pub"])).returncode == 0


def test_install_reload_without_a_service_is_refused_before_switching(kit) -> None:
    committed(kit, "A")
    before = sorted(p.name for p in kit["ota"].versions.iterdir())
    r = install(kit, "B", "--reload")
    assert r.returncode == 69 and "Traceback" not in r.stderr, r.stderr
    assert "no running edge service answers on a control socket" in r.stderr and "Nothing was switched" in r.stderr
    assert str(kit["dir"] / "state" / "control.sock") in r.stderr  # every place it looked is named
    assert kit["ota"].link_target("current") == A and sorted(p.name for p in kit["ota"].versions.iterdir()) == before
    assert [h["event"] for h in kit["ota"].state()["history"]][-1] == "committed"  # no "rollback unhealthy"


def test_a_config_only_update_by_reload_keeps_the_loaded_model(kit) -> None:
    """Same content, same inode in both versions: the reload takes the loaded model over (no
    load, no page-in) and only the config changes."""
    bundles = _reload_bundles(kit, f'[paths]\nstate_dir = "{kit["dir"] / "state"}"\n')
    with _serving_current(kit, bundles["1.0.0"]):
        r = edge_ota(kit, "install", str(bundles["1.1.0"]), "--pubkey", str(kit["pub"]), "--reload", "--timeout", "120")
        assert r.returncode == 0, r.stderr
        versions = kit["ota"].versions
        same = [os.stat(versions / v / "models" / "a.gguf").st_ino for v in ("1.0.0", "1.1.0")]
        assert same[0] == same[1]
        assert json.loads(r.stdout)["reload"] == {"kept": ["m"], "loaded": [], "mode": json.loads(r.stdout)["reload"]["mode"]}


def test_the_ota_tree_is_readable_by_the_service_whatever_the_installers_umask(kit) -> None:
    """docs/ota.md "End to end": root installs (umask 022 in a shell) and the unit's drop-in
    recovers under UMask=0077 (`ExecStartPre=-+…`); the service reads the tree as its own
    DynamicUser=. Run under umask 077, `recover` (which records the factory config) and
    `install` leave every file of the tree readable and every folder searchable by others."""
    import stat

    def under_umask_077(*args: str) -> None:
        r = subprocess.run([*EDGE, "ota", *args, "--config", str(kit["cfg"])], capture_output=True, text=True,
                           timeout=120, preexec_fn=lambda: os.umask(0o077))
        assert r.returncode == 0, r.stderr

    kit["cfg"].write_text(kit["cfg"].read_text().replace('path = "x.gguf"', f'path = "{kit["a"]}"'))
    under_umask_077("recover", "--boot")
    under_umask_077("install", str(kit["bundles"]["A"]), "--pubkey", str(kit["pub"]), "--no-activate")
    root = kit["ota"].root
    assert (root / "current" / "edge.toml").is_file()
    for p in [root, *root.rglob("*")]:
        if p.is_symlink() or p.name.endswith(".lock"):
            continue
        mode = p.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0)
        assert mode & need == need, f"{p.relative_to(root)}: {oct(mode)}"
