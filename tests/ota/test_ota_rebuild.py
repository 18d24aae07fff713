"""What a state rebuild (edge/ota/rebuild.py) keeps when state.json, or both state slots, are
lost, through the real CLI: the anti-downgrade floor (every version's .complete marker carries
the highest version committed, and the current version's marker is never pruned), and the last
install's result, which `edge_ota_last_result` shows: a rollback stays a rollback, a rebuild that
cannot tell says `unknown`, never a success."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from edge.fleet.metrics import FleetCollector
from kit.ota import MODEL_CFG, build_version, device, edge_ota
from kit.prom import samples

VERSIONS = ("2026.1.1", "2026.1.2", "2026.1.3")


@pytest.fixture()
def dev(tmp_path: Path):
    d = device(tmp_path, model_bytes=4096, keep=2)
    d["cfg"].write_text(d["cfg"].read_text() + "[ota]\nkeep_versions = 3\n")
    d["bundles"] = {v: build_version(d, v, config=MODEL_CFG + f"# {v}\n") for v in (*VERSIONS, "2026.1.3-rc.1")}
    return d


def run(dev, *args: str) -> dict:
    r = edge_ota(dev, *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def install(dev, version: str, *extra: str):
    return edge_ota(dev, "install", str(dev["bundles"][version]), "--pubkey", str(dev["pub"]), "--no-activate", *extra)


def keep(dev, n: int) -> None:
    """[ota] keep_versions from now on (2 at a rollback: the rolled back version is pruned at once)."""
    dev["cfg"].write_text(dev["cfg"].read_text().replace("keep_versions = 3", f"keep_versions = {n}"))


def lose(dev, *names: str) -> None:
    for name in names:
        (dev["ota"].root / name).write_bytes(b"")


def last_result(dev) -> dict[str, str]:
    """edge_ota_last_result as /metrics shows it."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(dev["dir"] / "state", lambda: None, device=dict))
    (found,) = samples(generate_latest(registry).decode())["edge_ota_last_result"]
    return found.labels


def test_the_downgrade_floor_survives_losing_both_state_slots_after_a_rollback(dev) -> None:
    for v in VERSIONS:
        assert install(dev, v).returncode == 0 and edge_ota(dev, "commit").returncode == 0
    keep(dev, 2)
    assert run(dev, "rollback", "--no-activate")["version"] == "2026.1.2"  # 2026.1.3 failed, and pruned
    assert sorted(p.name for p in dev["ota"].versions.iterdir()) == ["2026.1.1", "2026.1.2"]
    r = install(dev, "2026.1.3-rc.1")
    assert r.returncode == 65 and "older than 2026.1.3" in r.stderr, r.stderr
    lose(dev, "state.json", "state.json.prev")
    st = run(dev, "status")
    assert st["highest"] == "2026.1.3" and st["current"] == "2026.1.2" and "rebuilt" in st
    r = install(dev, "2026.1.3-rc.1")
    assert r.returncode == 65 and "older than 2026.1.3" in r.stderr, r.stderr
    assert edge_ota(dev, "status", "--field", "highest").stdout.strip() == "2026.1.3"
    assert install(dev, "2026.1.3-rc.1", "--allow-downgrade").returncode == 0  # on purpose: still possible


def test_a_rebuild_after_a_rollback_keeps_it_a_rollback(dev) -> None:
    for v in VERSIONS[:2]:
        assert install(dev, v).returncode == 0 and edge_ota(dev, "commit").returncode == 0
    assert install(dev, "2026.1.3").returncode == 0
    assert run(dev, "rollback", "--no-activate")["failed"] == "2026.1.3"
    assert last_result(dev) == {"version": "2026.1.3", "result": "rolled_back"}
    lose(dev, "state.json")  # state.json.prev holds the state before: 2026.1.3 pending
    assert run(dev, "recover", "--boot")["result"] == "nothing pending"
    history = run(dev, "status")["history"]
    assert [h["event"] for h in history[-2:]] == ["rolled back", "state rebuilt"]
    assert history[-2]["version"] == "2026.1.3" and "derived by the state rebuild" in history[-2]["reason"]
    assert last_result(dev) == {"version": "2026.1.3", "result": "rolled_back"}  # the alert stays


@pytest.mark.parametrize("kept, result", [(3, "rolled_back"), (2, "unknown")])
def test_a_rebuild_from_the_markers_alone_never_says_committed_after_a_rollback(dev, kept, result) -> None:
    """Both slots lost: the rolled back version's marker says failed; once it is pruned, nothing
    on the device tells a rollback from a commit, and the answer is unknown."""
    for v in VERSIONS:
        assert install(dev, v).returncode == 0 and edge_ota(dev, "commit").returncode == 0
    keep(dev, kept)
    run(dev, "rollback", "--no-activate")
    lose(dev, "state.json", "state.json.prev")
    run(dev, "recover", "--boot")
    assert last_result(dev)["result"] == result


def test_a_rebuild_that_cannot_tell_says_unknown(dev) -> None:
    assert install(dev, "2026.1.1").returncode == 0 and edge_ota(dev, "commit").returncode == 0
    marker = dev["ota"].versions / "2026.1.1" / ".complete"
    marker.write_bytes(b"2026.1.1\ncommitted".ljust(255) + b"\n")  # an older edge's marker: no time
    lose(dev, "state.json", "state.json.prev")
    run(dev, "recover", "--boot")
    assert last_result(dev) == {"version": "", "result": "unknown"}
