"""Every end of an `edge ota` command is a documented exit code with one line, through the real
CLI: ENOSPC at each file-system operation of a commit and of a rollback (EDGE_OTA_ENOSPC_AT_OP)
is 75 naming the file and the state left (or 0 where the command can do without that write),
and running the command again converges; an answer that stdout cannot take is 74 with the work
done; an install with no signing key is the config's fault, 78."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.ota.install import Ota
from kit.ota import MODEL_CFG, build_version, device, edge_ota, fill, tmpfs


@pytest.fixture()
def dev(tmp_path: Path):
    return device(tmp_path, model_bytes=4096, keep=2)


def _pending(dev) -> None:
    """1.0.0 committed, 1.1.0 installed and not committed."""
    for v, commit in (("1.0.0", True), ("1.1.0", False)):
        b = build_version(dev, v, config=MODEL_CFG + f"# {v}\n")
        assert edge_ota(dev, "install", str(b), "--pubkey", str(dev["pub"]), "--no-activate").returncode == 0
        if commit:
            assert edge_ota(dev, "commit").returncode == 0


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("command, done", [(("commit",), "1.1.0"), (("rollback", "--no-activate"), "1.0.0")])
def test_enospc_at_every_operation_is_one_line_and_the_command_converges_when_run_again(dev, tmp_path: Path,
                                                                                         command, done) -> None:
    _pending(dev)
    state = tmp_path / "state"
    template = tmp_path / "template"
    shutil.copytree(state, template, symlinks=True)
    log = tmp_path / "ops.log"
    assert edge_ota(dev, *command, env={"EDGE_OTA_FS_LOG": str(log)}).returncode == 0
    ops = log.read_text().splitlines()
    assert len(ops) >= 4 and any(" exchange " in o for o in ops) and any(" overwrite " in o for o in ops)
    codes = set()
    for n in range(1, len(ops) + 1):
        shutil.rmtree(state)
        shutil.copytree(template, state, symlinks=True)
        r = edge_ota(dev, *command, env={"EDGE_OTA_ENOSPC_AT_OP": str(n)})
        codes.add(r.returncode)
        assert r.returncode in (0, 75), (ops[n - 1], r.stderr)
        if r.returncode == 75:
            line = _one_line(r)
            assert "No space left on device" in line and "the OTA state is current" in line, line
            again = edge_ota(dev, *command)  # free space: run it again
            assert again.returncode in (0, 65) and "Traceback" not in again.stderr, (ops[n - 1], again.stderr)
            if again.returncode == 65:  # the first run got that far: nothing is left to do
                assert "nothing to commit" in again.stderr or "nothing to roll back" in again.stderr, again.stderr
        ota = Ota(dev["ota"].root)
        ota.recover(None)  # at boot
        st = ota.status()
        assert st["current"] == done and st["pending"] is None and st["links"]["current"] == done, ops[n - 1]
    assert 75 in codes


def _damaged(dev, kind: str) -> Path:
    """1.0.0 and 2.0.0 committed (each its own model), 2.0.0's model damaged; 2.0.0's bundle."""
    from kit.ota import damage

    other = dev["dir"] / "other.gguf"
    other.write_bytes(os.urandom(4096))
    bundles = {v: build_version(dev, v, config=MODEL_CFG + f"# {v}\n", model=m)
               for v, m in (("1.0.0", dev["model"]), ("2.0.0", other))}
    for v in ("1.0.0", "2.0.0"):
        assert edge_ota(dev, "install", str(bundles[v]), "--pubkey", str(dev["pub"]), "--no-activate").returncode == 0
        assert edge_ota(dev, "commit").returncode == 0
    model = dev["ota"].root / "current" / "models" / "m.gguf"
    if kind == "content":
        damage(model)
    else:  # a symlink to a copy outside: the store's object is intact, the repair links it again
        outside = dev["dir"] / "outside"
        outside.write_bytes(model.read_bytes())
        model.unlink()
        model.symlink_to(outside)
    return bundles["2.0.0"]


@pytest.mark.parametrize("kind, command", [("content", "re-push"), ("type", "recover --boot")])
def test_enospc_at_every_operation_of_a_repair_is_75_and_the_repair_converges(dev, tmp_path: Path, kind: str,
                                                                               command: str) -> None:
    """A repair on a file system that fills at any one of its operations: 75 with one line (or 0
    where it does without that write), never 65 or a traceback; run again, it is repaired."""
    bundle = _damaged(dev, kind)
    args = (["install", str(bundle), "--pubkey", str(dev["pub"]), "--no-activate"] if command == "re-push"
            else ["recover", "--boot", "--pubkey", str(dev["pub"])])
    state, template = tmp_path / "state", tmp_path / "template"
    subprocess.run(["cp", "-a", str(state), str(template)], check=True)  # hard links kept
    log = tmp_path / "ops.log"
    assert edge_ota(dev, *args, env={"EDGE_OTA_FS_LOG": str(log)}).returncode == 0
    ops = log.read_text().splitlines()
    assert any(" rename " in o or " chmod " in o or " link " in o for o in ops), ops
    codes = set()
    for n in range(1, len(ops) + 1):
        shutil.rmtree(state)
        subprocess.run(["cp", "-a", str(template), str(state)], check=True)
        r = edge_ota(dev, *args, env={"EDGE_OTA_ENOSPC_AT_OP": str(n)})
        codes.add(r.returncode)
        assert r.returncode in (0, 75), (ops[n - 1], r.returncode, r.stderr)
        if r.returncode == 75:
            assert "No space left on device" in _one_line(r), (ops[n - 1], r.stderr)
            again = edge_ota(dev, *args)
            assert again.returncode == 0, (ops[n - 1], again.stderr)
        verify = edge_ota(dev, "verify", "--pubkey", str(dev["pub"]))
        assert verify.returncode == 0, (ops[n - 1], verify.stderr)
        st = Ota(dev["ota"].root).status()
        # --no-activate: the repair is done, its activation owed to the next install, recover or start
        assert st["current"] == "2.0.0" and (st["repair"] is None or st["repair"]["activate"]), ops[n - 1]
    assert 75 in codes


def test_an_answer_stdout_cannot_take_is_74_and_the_commit_stands(dev, tmp_path: Path) -> None:
    from kit import EDGE

    _pending(dev)
    with tmpfs(tmp_path / "full", "64k") as mnt:
        out = mnt / "answer.json"
        out.touch()
        fill(mnt, inodes=False)
        with open(out, "w") as stdout:
            r = subprocess.run([*EDGE, "ota", "commit", "--config", str(dev["cfg"])], stdout=stdout,
                               stderr=subprocess.PIPE, text=True, timeout=120)
    line = _one_line(r)
    assert r.returncode == 74 and line.startswith("edge: error: stdout: No space left on device"), r.stderr
    assert "the command completed" in line
    st = json.loads(edge_ota(dev, "status").stdout)
    assert st["current"] == "1.1.0" and st["pending"] is None


def test_install_without_a_signing_key_is_the_configs_fault(dev) -> None:
    b = build_version(dev, "1.0.0")
    dev["cfg"].write_text(dev["cfg"].read_text() + f'[ota]\npubkey = "{dev["dir"] / "no-such.pub"}"\n')
    r = edge_ota(dev, "install", str(b))
    assert r.returncode == 78, r.stderr
    line = _one_line(r)
    assert f"{dev['cfg']}: ota.pubkey: no bundle signing key at {dev['dir'] / 'no-such.pub'}" in line


# -- closed streams: `>&-` on the real command line (issue 45) -----------------------------------
CLOSED = {"stdout": ">&-", "stderr": "2>&-", "both": ">&- 2>&-"}


def _closed(dev, how: str, *args: str) -> subprocess.CompletedProcess:
    """`edge ARGS` run by bash with the stream(s) `how` closed; what the open one(s) said."""
    from kit import EDGE

    line = " ".join(shlex.quote(a) for a in [*EDGE, *args]) + " " + CLOSED[how]
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)


def _sequence(dev) -> list[tuple[list[str], int]]:
    """Every `edge ota` command, in an order where each succeeds (0 on open streams), then two
    that fail (nothing to commit: 65; a missing bundle: 65)."""
    cfg, pub, key = ["--config", str(dev["cfg"])], str(dev["pub"]), str(dev["key"])
    bundle = str(dev["dir"] / "closed.edgeb")
    config = dev["dir"] / "bundle.toml"
    config.write_text(MODEL_CFG)
    return [(["ota", "keygen", "-o", str(dev["dir"] / "second.key")], 0),
            (["ota", "build", "--version", "1.0.0", "--key", key, "--config", str(config), "--model",
              str(dev["model"]), "-o", bundle], 0),
            (["ota", "inspect", bundle, "--pubkey", pub], 0),
            (["ota", "inspect", bundle, "--field", "version"], 0),
            (["ota", "install", bundle, "--pubkey", pub, "--no-activate", *cfg], 0),
            (["ota", "status", *cfg], 0),
            (["ota", "status", "--field", "pending", *cfg], 0),
            (["ota", "commit", *cfg], 0),
            (["ota", "verify", "--pubkey", pub, *cfg], 0),
            (["ota", "install", str(build_version(dev, "1.1.0", config=MODEL_CFG + "# 1.1\n")), "--pubkey", pub,
              "--no-activate", *cfg], 0),
            (["ota", "rollback", "--no-activate", *cfg], 0),
            (["ota", "recover", "--boot", *cfg], 0),
            (["ota", "commit", *cfg], 65),
            (["ota", "install", str(dev["dir"] / "none.edgeb"), "--pubkey", pub, *cfg], 65)]


@pytest.mark.parametrize("how", list(CLOSED))
def test_every_command_with_a_closed_stream_ends_in_its_documented_code_and_no_traceback(dev, how: str) -> None:
    for args, code in _sequence(dev):
        r = _closed(dev, how, *args)
        said = r.stdout + r.stderr
        assert "Traceback" not in said, (args, said)
        if how == "stderr":  # the answer on stdout as always, the code as on open streams
            assert r.returncode == code and r.stderr == "", (args, r.returncode, said)
            assert (r.stdout != "") == (code == 0), (args, said)
            continue
        assert r.stdout == "", (args, said)  # nothing can land on a closed stdout
        assert r.returncode == (74 if code == 0 else code), (args, r.returncode, said)
        if how == "stdout":
            line = _one_line(r)
            assert ("stdout is closed: the command completed" in line) == (code == 0), (args, line)
        else:
            assert r.stderr == "", (args, said)
    st = Ota(dev["ota"].root).status()  # the work was done although no answer could be written
    assert st["current"] == "1.0.0" and st["pending"] is None and "1.1.0" in st["on_disk"]
