"""A repair is never half-done (edge/ota/repair.py), as a generated matrix: every damage kind
(content, type, mode, link, object, manifest, signature) x every repair path (the current
version's bundle pushed again; `edge ota recover --boot`; the service's own start) x a kill -9 at
every file operation of that path, delivered by the kernel (strace's syscall injection,
tests/kit/crashpoints.py: every system call that changes a file under the OTA root, and the
spawn of the activation), each followed by the same path run again, which must converge: the
genuine bytes served (the repaired 2.0.0) or the version before them (1.0.0, where this device
has no intact copy), `edge ota verify` 0, no repair left unfinished.

"Served" is what a service maps: for the bundle pushed again, the bytes its activation (a
restart command) finds, logged at each restart, from the bytes the running service mapped when
the damage happened; at boot, what the start after it opens; for the start, the model file the
real `edge serve` maps (/proc/<pid>/maps: its inode, hashed), checked at READY.

The matrix's kill points are recorded from an uninterrupted run of each cell, so its size follows
the code: the test prints each cell's. EDGE_OTA_MATRIX=full kills at every point of every cell;
by default a deterministic sample kills at SAMPLE points of each cell, spread over its points and
different from cell to cell, so every damage kind and every path is covered in a CI run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.ota.bundle import build_bundle, keygen
from harness.ggufgen import write_tiny_llama
from kit import EDGE, PidOne
from kit.crashpoints import kill_at, pristine, record, strace
from kit.ota import damage, healthy_url

PATHS = ("re-push", "recover --boot", "start")
DAMAGES = ("content", "type", "mode", "link", "object", "manifest", "signature")
# with no intact copy on the device (content: the version's file is its store object) or no
# manifest that verifies, a boot or a start serves the version before; its bundle repairs all
FALLS_BACK = {(d, p) for d in ("content", "manifest", "signature") for p in ("recover --boot", "start")}
FULL = os.environ.get("EDGE_OTA_MATRIX") == "full"
SAMPLE = 1  # kill points per cell in a default run (21 in all: every damage kind x every path)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(work: Path, pub: Path, model: str, note: str) -> str:
    return (f'[paths]\nstate_dir = "{work}"\n[ota]\npubkey = "{pub}"\nkeep_versions = 3\n'
            f'[[models]]\nname = "m"\npath = "models/{model}"\nn_ctx = 256\n[warmup]\ndecode_tokens = 4\n# {note}\n')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    """1.0.0 and 2.0.0 committed (their own tiny models), kept as a template; every run works in
    the same `work` dir, which the bundles' configs name as their state dir."""
    if strace() is None:
        pytest.skip("strace is not installed (Debian's strace: the matrix kills through its syscall injection)")
    d = tmp_path_factory.mktemp("matrix")
    work = d / "state"
    key = d / "signing.key"
    pub = keygen(key)
    models = {v: write_tiny_llama(d / f"{v}.gguf", seed=s) for v, s in (("1.0.0", 3), ("2.0.0", 4))}
    bundles = {}
    for v, model in models.items():
        bundles[v] = d / f"{v}.edgeb"
        build_bundle(bundles[v], version=v, files=[(model, "models/m.gguf", "model", None)],
                     config=_config(work, pub, "m.gguf", v), key=key)
    cfg = d / "device.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{work}"\n[ota]\npubkey = "{pub}"\nkeep_versions = 3\n'
                   '[[models]]\nname = "x"\npath = "x.gguf"\n')
    for v in ("1.0.0", "2.0.0"):
        for args in (["install", str(bundles[v]), "--no-activate"], ["commit"]):
            r = subprocess.run([*EDGE, "ota", *args, "--config", str(cfg)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
    template = d / "template"
    pristine(work, template)
    url, server = healthy_url()
    restart = d / "restart"  # the service restarted: it maps what current/ holds now (logged)
    restart.write_text(f"#!/bin/sh\nsha256sum {work}/ota/current/models/m.gguf | cut -d' ' -f1 >> {d}/served.log\n")
    restart.chmod(0o755)
    yield {"dir": d, "work": work, "pub": pub, "cfg": cfg, "bundles": bundles, "template": template,
           "genuine": {v: _sha(m) for v, m in models.items()}, "url": url, "restart": restart,
           "served": d / "served.log"}
    server.shutdown()




def _damage(fleet, kind: str) -> None:
    """The current version (2.0.0) damaged one way: what a device in the field shows."""
    cur = fleet["work"] / "ota" / "versions" / "2.0.0"
    model = cur / "models" / "m.gguf"
    manifest = json.loads((cur / "manifest.json").read_text())
    obj = fleet["work"] / "ota" / "objects" / "sha256" / manifest["files"][0]["sha256"]
    if kind == "content":
        damage(model, at=model.stat().st_size - 4096)  # flash bit-rot in the weights: same inode, size, mode
    elif kind == "type":  # a symlink to a file with the right bytes, outside the store
        outside = fleet["dir"] / "outside.gguf"
        outside.write_bytes(model.read_bytes())
        model.unlink()
        model.symlink_to(outside)
    elif kind == "mode":
        model.chmod(0)  # the store's object too: one inode
    elif kind in ("link", "object"):  # a copy of its own (right bytes and mode), not the store's object
        copy = model.with_name("copy")
        shutil.copyfile(model, copy)
        copy.chmod(0o444)
        copy.replace(model)
        if kind == "object":
            damage(obj, at=obj.stat().st_size - 4096)  # and the store's object damaged
    elif kind == "manifest":  # one hash digit changed, still valid JSON
        sha = manifest["files"][0]["sha256"]
        manifest["files"][0]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]
        (cur / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    elif kind == "signature":
        (cur / "manifest.sig").write_bytes(b"\0" * 64)


def _argv(fleet, path: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "EDGE_TEST_FAULT"}
    cfg = ["--config", str(fleet["cfg"])]
    if path == "re-push":
        return [*EDGE, "ota", "install", str(fleet["bundles"]["2.0.0"]), *cfg, "--pubkey", str(fleet["pub"]),
                "--restart-cmd", str(fleet["restart"]), "--health-url", fleet["url"], "--timeout", "60"], env
    if path == "recover --boot":
        return [*EDGE, "ota", "recover", "--boot", *cfg], env
    # the start, up to its config phase (EDGE_TEST_FAULT ends it there): its OTA check is before it
    served = str(fleet["work"] / "ota" / "current" / "edge.toml")
    return [*EDGE, "serve", "--config", served], {**env, "EDGE_TEST_FAULT": "config:KILL"}


def _fresh(fleet, snapshot: Path) -> None:
    pristine(snapshot, fleet["work"])
    # what the running service maps when the damage happened: the bytes behind current/ now
    fleet["served"].write_text(_sha(fleet["work"] / "ota" / "current" / "models" / "m.gguf") + "\n")


def _served_by_a_start(fleet) -> str:
    """The sha256 of the model file a real `edge serve` maps at READY (its inode, from /proc)."""
    with PidOne([*EDGE, "serve", "--config", str(fleet["work"] / "ota" / "current" / "edge.toml")]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        maps = Path(f"/proc/{pid1.proc.pid}/maps").read_text()
        mapped = {line.split(None, 5)[5] for line in maps.splitlines()
                  if line.count(" ") >= 5 and line.rstrip().endswith("m.gguf")}
        assert len(mapped) == 1 and "(deleted)" not in next(iter(mapped)), maps
        return _sha(Path(next(iter(mapped))))


def _converged(fleet, path: str, why: str, started: str | None = None) -> str:
    """Which version serves ("2.0.0" repaired, "1.0.0" fallen back to), after every check;
    `started`: what the start that converged maps."""
    r = subprocess.run([*EDGE, "ota", "verify", "--config", str(fleet["cfg"])], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (why, r.stderr[-3000:])
    st = json.loads(subprocess.run([*EDGE, "ota", "status", "--config", str(fleet["cfg"])], capture_output=True,
                                   text=True, timeout=60).stdout)
    assert st["pending"] is None and st["repair"] is None and st["retire"] is None, (why, st)
    current = st["current"]
    assert st["links"]["current"] == current and current in ("1.0.0", "2.0.0"), (why, st)
    genuine = fleet["genuine"][current]
    if path == "re-push":
        served = fleet["served"].read_text().split()[-1]
    elif path == "start":
        served = started or ""
    else:  # at boot, the start after it opens what current/ holds
        served = _sha(fleet["work"] / "ota" / "current" / "models" / "m.gguf")
    assert served == genuine, (why, current, "served bytes are not the genuine ones")
    return current


def _converge(fleet, path: str, why: str) -> str | None:
    """The same path again: the command once more; for a start, a real start to READY (what it
    maps, returned)."""
    if path == "start":
        return _served_by_a_start(fleet)
    argv, env = _argv(fleet, path)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (why, r.returncode, r.stderr[-3000:])


def _chosen(n: int, cell: int) -> list[int]:
    """Every point (EDGE_OTA_MATRIX=full), else SAMPLE of them spread over the cell's points,
    starting at another place in each cell (the golden ratio: no two cells alike)."""
    if FULL or n <= SAMPLE:
        return list(range(n))
    start = (cell * 0.618034) % 1.0
    return sorted({int(((start + k / SAMPLE) % 1.0) * n) for k in range(SAMPLE)})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", DAMAGES)
def test_every_kill_point_of_a_repair_converges(fleet, kind: str, path: str, tmp_path: Path) -> None:
    expected = "1.0.0" if (kind, path) in FALLS_BACK else "2.0.0"
    pristine(fleet["template"], fleet["work"])
    _damage(fleet, kind)
    snapshot = tmp_path / "damaged"
    pristine(fleet["work"], snapshot)
    _fresh(fleet, snapshot)
    argv, env = _argv(fleet, path)
    r, points = record(argv, env, fleet["work"] / "ota", tmp_path / "strace.log")
    assert r.returncode == (-9 if path == "start" else 0) and "Traceback" not in r.stderr, r.stderr[-3000:]
    started = _served_by_a_start(fleet) if path == "start" else None
    assert _converged(fleet, path, "uninterrupted", started) == expected
    assert points, "no file operation recorded under the OTA root"
    if path == "re-push" and kind in ("content", "type"):  # a served file changed: the activation is a point
        assert any(p.syscall in ("vfork", "clone", "clone3") for p in points), [p.where() for p in points]
    cell = DAMAGES.index(kind) * len(PATHS) + PATHS.index(path)
    chosen = _chosen(len(points), cell)
    print(f"matrix cell {kind} x {path}: {len(points)} kill points, killed at {len(chosen)}")
    for i in chosen:
        point = points[i]
        why = f"{kind} x {path}, killed at #{i} {point.where()}"
        _fresh(fleet, snapshot)
        kill_at(argv, env, point, tmp_path / "kill.log")
        started = _converge(fleet, path, why)
        assert _converged(fleet, path, why, started) == expected, why
