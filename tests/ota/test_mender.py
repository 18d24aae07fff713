"""The Mender update module (scripts/mender/edge-bundle) driven by the real Mender client in
standalone mode (Debian's mender-client 3.4 and mender-artifact 3.9, installed by scripts/setup):
install + commit, a bundle whose health check fails, `mender rollback` of a pending install (a
first install included), an artifact with two payloads, and a kill -9 of everything mid-install
followed by the boot-time `edge ota recover --boot` (a power cut)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from edge.ota.bundle import build_bundle
from kit import EDGE, PidOne, post
from kit.ota import A, B, cfg_text, committed  # fixtures `kit`, `live`: kit/ota.py

MODULE = Path(__file__).resolve().parents[2] / "scripts" / "mender" / "edge-bundle"
WRITE_ARTIFACT = MODULE.with_name("write-artifact")
MODULES_DIR = Path("/usr/share/mender/modules/v3")  # fixed in mender-client 3.4 (not configurable)
ARTIFACT_INFO = Path("/etc/mender/artifact_info")  # read by standalone installs before the first


def _why_not() -> str | None:
    for tool in ("mender", "mender-artifact"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup installs Debian's mender-client and mender-artifact)"
    if not os.access(MODULES_DIR, os.W_OK):
        return f"{MODULES_DIR} is not writable: the real client only runs update modules from there"
    if not ARTIFACT_INFO.exists() and not os.access(ARTIFACT_INFO.parent, os.W_OK):
        return f"{ARTIFACT_INFO} is absent and cannot be created"
    return None


@pytest.fixture()
def mender(kit, tmp_path: Path):
    """A standalone Mender client with its own data dir and a uniquely named copy of the module
    (artifact type edge-bundle-<id>) whose environment points at this test's device."""
    why = _why_not()
    if why:
        print(f"test_mender: skipped: {why}")
        pytest.skip(why)
    kind = f"edge-bundle-test-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "mender-data"
    data.mkdir()
    (data / "device_type").write_text("device_type=edge-test\n")
    conf = tmp_path / "mender.conf"
    conf.write_text(json.dumps({"DeviceTypeFile": str(data / "device_type")}))
    edge_bin = tmp_path / "edge"
    edge_bin.write_text(f"#!/bin/sh\nexec {' '.join(EDGE)} \"$@\"\n")
    edge_bin.chmod(0o755)
    env_file = tmp_path / "module.env"  # the test changes EDGE_OTA_ARGS between installs
    env_file.write_text("")
    module = MODULES_DIR / kind
    module.write_text(f"#!/bin/sh\nexport EDGE_BIN={edge_bin} EDGE_CONFIG={kit['cfg']} EDGE_OTA_PUBKEY={kit['pub']}\n"
                      f". {env_file}\nexec sh {MODULE} \"$@\"\n")
    module.chmod(0o755)
    made_info = not ARTIFACT_INFO.exists()
    if made_info:
        ARTIFACT_INFO.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT_INFO.write_text("artifact_name=edge-test-initial\n")

    argv = ["mender", "-c", str(conf), "-b", str(tmp_path / "none.conf"), "-d", str(data), "--no-syslog"]

    def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout)

    def artifact(name: str, *bundles: Path) -> Path:
        out = tmp_path / f"{name}.mender"
        files = [a for b in bundles for a in ("-f", str(b))]
        subprocess.run(["mender-artifact", "write", "module-image", "-T", kind, "-t", "edge-test", "-n", name,
                        *files, "-o", str(out)], check=True, capture_output=True)
        return out

    def args(value: str) -> None:
        env_file.write_text(f"export EDGE_OTA_ARGS='{value}'\n")

    yield {"run": run, "argv": argv, "artifact": artifact, "args": args, "kind": kind, "edge_bin": str(edge_bin)}
    module.unlink(missing_ok=True)
    if made_info:
        ARTIFACT_INFO.unlink(missing_ok=True)


def _bundle(kit, version: str, model: Path, config: str | None = None) -> Path:
    out = kit["dir"] / f"{version}.edgeb"
    build_bundle(out, version=version, files=[(model, f"models/{model.name}", "model", None)],
                 config=config or cfg_text(model.name), key=kit["key"])
    return out


def test_first_install_rolled_back_by_mender_returns_the_service_to_its_factory_config(kit, mender) -> None:
    """Before OTA: the device config serves model b (by a path relative to it). The first install
    (model a, by zero-gap reload) is rolled back by `mender rollback`: the service serves b again,
    from the factory copy recorded at the first install, in the same process throughout."""
    state = kit["dir"] / "state"
    kit["cfg"].write_text(f'[paths]\nstate_dir = "{state}"\n[[models]]\nname = "m"\npath = "b.gguf"\n'
                          'n_ctx = 256\n[warmup]\ndecode_tokens = 4\n')
    r = subprocess.run([*EDGE, "ota", "recover", "--boot", "--config", str(kit["cfg"])], capture_output=True,
                       text=True, timeout=120)  # at boot, before the service: OTA takes over
    assert r.returncode == 0, r.stderr
    st = kit["ota"].status()
    assert st["links"]["current"] == "factory" and st["factory"]["config"] == str(kit["cfg"])
    assert f'path = "{kit["b"]}"' in (kit["ota"].root / "current" / "edge.toml").read_text()  # made absolute
    req = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    mender["args"]("--reload --timeout 120")
    artifact_before = mender["run"]("show-artifact").stdout.strip()
    with PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")]) as live:
        live.start()
        live.wait_for("READY", "1")
        pid = live.proc.pid
        factory = post(live.address, "/v1/completions", req)[1]["choices"][0]["text"]
        r = mender["run"]("install", str(mender["artifact"]("art-a", kit["bundles"]["A"])))
        assert r.returncode == 0, r.stderr[-2000:]
        assert kit["ota"].state()["pending"]["version"] == A
        first = post(live.address, "/v1/completions", req)[1]["choices"][0]["text"]
        r = mender["run"]("rollback")
        assert r.returncode == 0, r.stderr[-2000:]
        back = post(live.address, "/v1/completions", req)[1]["choices"][0]["text"]
        assert live.proc.pid == pid and live.proc.poll() is None
    assert first != factory and back == factory
    st = kit["ota"].status()
    assert st["current"] is None and st["pending"] is None and st["links"] == {"current": "factory", "previous": None}
    assert st["history"][-1]["event"] == "rolled back"
    assert mender["run"]("show-artifact").stdout.strip() == artifact_before  # Mender reports the factory state


def test_thin_artifacts_declare_their_base_and_mender_refuses_them_elsewhere(kit, mender, tmp_path: Path) -> None:
    """write-artifact: a full artifact provides its content digest; a thin one depends on its
    base's, so the client itself refuses it on a device without that base (the module never runs)."""
    from edge.ota.bundle import open_bundle
    from edge.ota.manifest import read_base

    env = {**os.environ, "EDGE_BIN": mender["edge_bin"]}

    def write(bundle: Path, name: str) -> Path:
        out = tmp_path / f"{name}.mender"
        r = subprocess.run([str(WRITE_ARTIFACT), str(bundle), "-t", "edge-test", "-n", name, "-o", str(out),
                            "-T", mender["kind"]], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return out

    mender["args"]("--no-activate")
    assert mender["run"]("install", str(write(kit["bundles"]["A"], "art-a"))).returncode == 0
    assert mender["run"]("commit").returncode == 0
    provides = mender["run"]("show-provides").stdout
    assert f"edge.content_digest={open_bundle(kit['bundles']['A'], kit['pub']).content_digest}" in provides
    thin = kit["dir"] / "thin.edgeb"  # 3.0.0: A's model, another config; thin on A
    build_bundle(thin, version="3.0.0", files=[(kit["a"], "models/a.gguf", "model", None)],
                 config=cfg_text("a.gguf", "[server]\nmax_queue = 9\n"), key=kit["key"], base=read_base(kit["bundles"]["A"]))
    elsewhere = kit["dir"] / "thin-b.edgeb"  # thin on B, which this device never had
    build_bundle(elsewhere, version="4.0.0", files=[(kit["b"], "models/b.gguf", "model", None)],
                 config=cfg_text("b.gguf", "[server]\nmax_queue = 9\n"), key=kit["key"], base=read_base(kit["bundles"]["B"]))
    r = mender["run"]("install", str(write(elsewhere, "art-elsewhere")))
    assert r.returncode != 0 and "edge.content_digest" in r.stderr, r.stderr[-2000:]
    assert kit["ota"].state()["current"] == A and kit["ota"].state()["pending"] is None
    assert thin.stat().st_size < kit["bundles"]["A"].stat().st_size // 10
    r = mender["run"]("install", str(write(thin, "art-thin")))
    assert r.returncode == 0, r.stderr[-2000:]
    assert mender["run"]("commit").returncode == 0
    assert kit["ota"].state()["current"] == "3.0.0"
    assert "edge.bundle_version=3.0.0" in mender["run"]("show-provides").stdout


def test_two_payloads_are_refused(kit, mender) -> None:
    committed(kit, "A")
    two = mender["artifact"]("art-two", kit["bundles"]["B"], kit["bundles"]["A"])
    r = mender["run"]("install", str(two))
    assert r.returncode != 0 and "exactly one .edgeb file, it carries 2" in r.stderr
    assert kit["ota"].state()["current"] == A and kit["ota"].state()["pending"] is None


def test_install_commit_failing_bundle_rollback_and_power_cut(kit, live, mender, tmp_path: Path) -> None:
    ota = kit["ota"]
    health = f"http://{live.address[0]}:{live.address[1]}/readyz"
    # the restart a service that cannot start version 3.0.0 would answer (it exits with its error)
    restart = _script(tmp_path / "restart", f'test "$(readlink {ota.root / "current"})" != versions/3.0.0 || '
                      '{ echo "model models/a.gguf: warm-up failed" >&2; exit 3; }')
    mender["args"](f"--restart-cmd {restart} --health-url {health} --timeout 60")
    r = mender["run"]("install", str(mender["artifact"]("art-b", kit["bundles"]["B"])))
    assert r.returncode == 0, r.stderr[-2000:]
    assert ota.state()["pending"]["version"] == B  # healthy, not permanent until ArtifactCommit
    assert mender["run"]("commit").returncode == 0
    assert ota.state()["current"] == B and ota.state()["pending"] is None
    assert mender["run"]("show-artifact").stdout.strip() == "art-b"

    bad = _bundle(kit, "3.0.0", kit["a"])
    r = mender["run"]("install", str(mender["artifact"]("art-bad", bad)))
    assert r.returncode != 0
    st = ota.state()
    assert st["current"] == B and st["pending"] is None and ota.link_target("current") == B
    assert st["history"][-1]["event"] == "rolled back" and "warm-up failed" in st["history"][-1]["reason"]
    assert mender["run"]("show-artifact").stdout.strip() == "art-b"

    good = _bundle(kit, "4.0.0", kit["a"])
    assert mender["run"]("install", str(mender["artifact"]("art-c", good))).returncode == 0
    assert mender["run"]("rollback").returncode == 0  # restores the state before the install
    assert ota.state()["current"] == B and ota.state()["previous"] == A and ota.link_target("current") == B

    # power cut: everything killed while the new version is switched in but not committed
    gate = tmp_path / "restarting"
    hang = _script(tmp_path / "hang", f"touch {gate}; sleep 600")
    mender["args"](f"--restart-cmd {hang} --health-url {health} --timeout 900")
    proc = subprocess.Popen([*mender["argv"], "install", str(mender["artifact"]("art-d", _bundle(kit, "5.0.0", kit["a"])))],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(gate.exists, proc)
    finally:
        _kill_tree(proc.pid)  # the power cut: mender, the module, edge and the restart, all at once
        proc.wait()
    assert ota.link_target("current") == "5.0.0" and ota.state()["pending"]["version"] == "5.0.0"
    r = subprocess.run([*EDGE, "ota", "recover", "--boot", "--config", str(kit["cfg"])], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "rolled back", r.stderr
    assert ota.link_target("current") == B  # never-committed 5.0.0 is not served after the "reboot"
    mender["args"](f"--restart-cmd true --health-url {health} --timeout 60")
    # standalone Mender kept no record of an install that died inside ArtifactInstall: commit and
    # rollback both answer 2 (no update in progress) and the old artifact is reported, as runs
    assert mender["run"]("commit").returncode == 2
    assert mender["run"]("rollback").returncode == 2
    assert ota.state()["current"] == B and ota.state()["pending"] is None
    assert mender["run"]("show-artifact").stdout.strip() == "art-b"


def _adapter_bundles(kit) -> tuple[Path, Path, Path]:
    """1.0.0: model a and adapter `tone` (tone-1); 1.1.0 thin on it: tone-2 alone carried; the
    service config each runs."""
    from edge.ota.manifest import read_base
    from harness.ggufgen import write_tiny_lora

    d = kit["dir"]
    out = []
    for v, lora, base in (("1.0.0", write_tiny_lora(d / "tone-1.gguf", seed=5), None),
                          ("1.1.0", write_tiny_lora(d / "tone-2.gguf", seed=6), d / "tone-1.0.0.edgeb")):
        config = cfg_text("a.gguf").replace("n_ctx = 256\n", "n_ctx = 256\nparallel = 4\n[[models.adapters]]\n"
                                            f'name = "tone"\npath = "adapters/{lora.name}"\n', 1)
        out.append(d / f"tone-{v}.edgeb")
        build_bundle(out[-1], version=v, files=[(kit["a"], "models/a.gguf", "model", None),
                                                (lora, f"adapters/{lora.name}", "adapter", None)],
                     config=config, key=kit["key"], base=read_base(base) if base else None)
    return out[0], out[1], d


def _tone(address: tuple[str, int]) -> str:
    status, answer = post(address, "/v1/completions", {"prompt": "Hello world. The", "max_tokens": 8,
                                                       "temperature": 0, "model": "m:tone"})
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _maps(pid: int) -> list[str]:
    return sorted(line.split()[0] + " " + line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if line.endswith("a.gguf"))


def test_a_thin_adapter_bundle_through_mender_reloads_keeping_the_model(kit, mender) -> None:
    """The real client installs a thin adapter artifact (the module's `--reload` activation) with
    8 clients sending meanwhile: no failed request, the model's mapping unchanged; `mender
    rollback` restores the previous adapter, again by a reload that keeps the model."""
    import concurrent.futures
    import threading

    full, thin, _ = _adapter_bundles(kit)
    r = subprocess.run([*EDGE, "ota", "install", str(full), "--pubkey", str(kit["pub"]), "--no-activate",
                        "--config", str(kit["cfg"])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert subprocess.run([*EDGE, "ota", "commit", "--config", str(kit["cfg"])], timeout=60).returncode == 0
    with PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")]) as live:
        live.start()
        live.wait_for("READY", "1")
        pid, before, old = live.proc.pid, _maps(live.proc.pid), _tone(live.address)
        stop, answers = threading.Event(), []

        def client() -> None:
            while not stop.is_set():
                answers.append(_tone(live.address))

        mender["args"]("--reload --timeout 120")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(client) for _ in range(8)]
            try:
                r = mender["run"]("install", str(mender["artifact"]("art-tone", thin)))
            finally:
                stop.set()
            for c in clients:
                c.result()  # no request failed
        assert r.returncode == 0, r.stderr[-2000:]
        assert kit["ota"].state()["pending"]["version"] == "1.1.0"
        new = _tone(live.address)
        assert new != old and set(answers) <= {old, new} and live.proc.pid == pid and _maps(pid) == before
        assert mender["run"]("rollback").returncode == 0
        assert kit["ota"].state()["current"] == "1.0.0" and kit["ota"].state()["pending"] is None
        assert _tone(live.address) == old and _maps(pid) == before


def test_a_repair_deployment_commits(kit, live, mender) -> None:
    """The artifact of the version the device runs, deployed again after its model lost a bit:
    ArtifactInstall repairs it in place and reloads the service onto the repaired file, and
    ArtifactCommit succeeds (there was nothing pending to commit): Mender reports the deployment
    installed, and nothing of the damaged file is mapped any more."""
    from kit.ota import damage

    ota = kit["ota"]
    model = ota.root / "current" / "models" / "a.gguf"
    damage(model, at=model.stat().st_size - 4096)
    mender["args"]("--reload --timeout 120")
    r = mender["run"]("install", str(mender["artifact"]("art-a-repair", kit["bundles"]["A"])))
    assert r.returncode == 0, r.stderr[-2000:]
    st = ota.state()
    assert st["current"] == A and st["pending"] is None and st["repair"] is None
    assert st["history"][-1]["event"] == "repaired" and "models/a.gguf" in st["history"][-1]["reason"]
    r = mender["run"]("commit")
    assert r.returncode == 0, r.stderr[-2000:]  # "nothing to commit" would fail the deployment
    assert mender["run"]("show-artifact").stdout.strip() == "art-a-repair"
    maps = Path(f"/proc/{live.proc.pid}/maps").read_text()
    assert "a.gguf (deleted)" not in maps and f"{ota.root}/versions/{A}/models/a.gguf" in maps
    r = subprocess.run([*EDGE, "ota", "verify", "--config", str(kit["cfg"]), "--pubkey", str(kit["pub"])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _kill_tree(root: int) -> None:
    """SIGKILL a process and all its descendants (Mender runs modules in their own groups)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _script(path: Path, body: str) -> Path:
    """EDGE_OTA_ARGS is split on blanks by the module's shell: a restart with spaces is a script."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _wait(cond, proc: subprocess.Popen) -> None:
    """Bounded polling of a real condition (the restart began), failing early if mender ended."""
    import time

    deadline = time.monotonic() + 120
    while not cond():
        assert proc.poll() is None, "mender ended before the restart began"
        assert time.monotonic() < deadline, "the restart did not begin within 120 s"
        time.sleep(0.05)


def test_module_states_without_the_client(kit, tmp_path: Path) -> None:
    """The protocol queries, ArtifactVerifyReboot with nothing pending (what a reboot leaves after
    the boot-time recover) and unknown states, called as Mender would call them."""
    edge_bin = tmp_path / "edge"
    edge_bin.write_text(f"#!/bin/sh\nexec {' '.join(EDGE)} \"$@\"\n")
    edge_bin.chmod(0o755)
    env = {**os.environ, "EDGE_BIN": str(edge_bin), "EDGE_CONFIG": str(kit["cfg"]), "EDGE_OTA_PUBKEY": str(kit["pub"])}
    (tmp_path / "files").mkdir()

    def state(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", str(MODULE), name, str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=120)

    assert state("SupportsRollback").stdout.strip() == "Yes"
    assert state("NeedsArtifactReboot").stdout.strip() == "No"
    committed(kit, "A")
    r = state("ArtifactVerifyReboot")
    assert r.returncode == 1 and "no edge install is pending" in r.stderr
    assert state("ProvidePayloadFileSizes").returncode == 0 and state("SomeFutureState").returncode == 0
    r = state("ArtifactInstall")
    assert r.returncode == 1 and "exactly one .edgeb file, it carries 0" in r.stderr
