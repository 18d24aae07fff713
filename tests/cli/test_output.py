"""An answer that cannot be written is never a silent 0 (edge/cli/output.py, one mechanism for
every command): each command that answers on stdout, run by bash with stdout closed (`>&-`) and
onto /dev/full, exits 74 with one line (a command that fails keeps its own code), never a
traceback; and a file a command is asked to write (`-o`) is written atomically: on a full file
system the old file stays whole, with exit 74."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import typer

from edge.cli.commands import app
from edge.timing import StartTimer, write_report
from kit import EDGE, write_config
from kit.ota import fill, tmpfs

# what each command needs that this test does not give it: a running service, a GPU, root on the
# host's systemd, a bundle and a device (tests/ota/test_ota_exit_codes.py runs every `edge ota`
# command the same way), or no stdout answer at all
NOT_HERE = {
    "serve": "serves until stopped: no answer on stdout",
    "reload": "needs a running service (tests/lifecycle: its answer is the same mechanism's)",
    "bench": "needs a running service",
    "stop": "prints nothing on success",
    "record-stop": "writes to stderr only (ExecStopPost=)",
    "build-engine": "needs TensorRT or ONNX Runtime and an ONNX model",
    "units install": "writes into the host's /etc/systemd/system",
    "engines rekey": "needs an engine built for another key",
    "ota keygen": "tests/ota/test_ota_exit_codes.py", "ota build": "tests/ota/test_ota_exit_codes.py",
    "ota inspect": "tests/ota/test_ota_exit_codes.py", "ota install": "tests/ota/test_ota_exit_codes.py",
    "ota rollback": "tests/ota/test_ota_exit_codes.py", "ota commit": "tests/ota/test_ota_exit_codes.py",
    "ota recover": "tests/ota/test_ota_exit_codes.py", "ota status": "tests/ota/test_ota_exit_codes.py",
    "ota verify": "tests/ota/test_ota_exit_codes.py",
}


def _commands() -> list[str]:
    def walk(cmd, prefix: list[str]):
        subs = getattr(cmd, "commands", None)
        if subs is None or (prefix and getattr(cmd, "invoke_without_command", False)):
            yield " ".join(prefix)
        for name, sub in (subs or {}).items():
            yield from walk(sub, prefix + [name])
    return [c for c in walk(typer.main.get_command(app), []) if c]


@pytest.fixture(scope="module")
def invocations(tmp_path_factory, tiny_gguf: Path) -> dict[str, list[str]]:
    d = tmp_path_factory.mktemp("output")
    cfg = str(write_config(d / "edge.toml", tiny_gguf))
    (d / "store").mkdir()
    write_report(StartTimer().report(sockets=["127.0.0.1:8088"]), d / "state")  # what `edge status` shows
    return {
        "status": ["status", "--config", cfg], "warmup": ["warmup", "--config", cfg],
        "doctor": ["doctor", "--config", cfg], "device": ["device"],
        "safe-mode": ["safe-mode", "--config", cfg], "safe-mode clear": ["safe-mode", "clear", "--config", cfg],
        "units print": ["units", "print"], "engines ls": ["engines", "ls", "--store", str(d / "store")],
        "engines verify": ["engines", "verify", "--store", str(d / "store")],
        "engines gc": ["engines", "gc", "--store", str(d / "store"), "--config", cfg],
        "fleet rules": ["fleet", "rules"], "fleet dashboard": ["fleet", "dashboard"],
        "fleet agent": ["fleet", "agent", "--remote-write", "https://fleet.example/api/v1/write",
                        "--target", "127.0.0.1:8088"],
    }


SILENT = ("engines verify", "engines gc")  # an empty store: nothing to say, exit 0


def test_every_command_is_run_here_or_says_where_it_is_tested(invocations) -> None:
    assert sorted(set(_commands()) - set(NOT_HERE)) == sorted(invocations)


def _bash(args: list[str], redirect: str) -> subprocess.CompletedProcess:
    line = " ".join(shlex.quote(a) for a in [*EDGE, *args]) + " " + redirect
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["status", "warmup", "doctor", "device", "safe-mode", "safe-mode clear",
                                  "units print", "engines ls", "engines verify", "engines gc", "fleet rules",
                                  "fleet dashboard", "fleet agent"])
def test_an_answer_that_cannot_be_written_is_74_with_one_line(invocations, name: str) -> None:
    args = invocations[name]
    opened = _bash(args, "")
    assert "Traceback" not in opened.stderr, opened.stderr
    code = opened.returncode
    said = opened.stdout != ""
    assert said == (name not in SILENT), (name, opened.stdout, opened.stderr)
    for redirect, why in ((">&-", "stdout is closed"), (">/dev/full", "stdout: No space left on device")):
        r = _bash(args, redirect)
        assert "Traceback" not in r.stderr, (name, redirect, r.stderr)
        if code == 0 and said:
            assert r.returncode == 74, (name, redirect, r.returncode, r.stderr)
            lines = [line for line in r.stderr.splitlines() if line.startswith("edge: error:")]
            assert lines == [f"edge: error: {why}: the command completed, but its answer could not be written"], \
                (name, r.stderr)
        else:  # its own verdict (or nothing to say): the same as on an open stdout
            assert r.returncode == code, (name, redirect, r.returncode, r.stderr)


@pytest.mark.parametrize("args", [["fleet", "dashboard"], ["fleet", "rules"],
                                  ["fleet", "agent", "--remote-write", "https://f.example/w", "--instance", "d1",
                                   "--target", "127.0.0.1:8088"]], ids=["dashboard", "rules", "agent"])
def test_output_files_are_written_atomically_and_a_full_disk_keeps_the_old_one(tmp_path: Path, args) -> None:
    out = tmp_path / "out"
    r = subprocess.run([*EDGE, *args, "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    whole = out.read_text()
    if args[1] == "dashboard":
        assert json.loads(whole)["uid"] == "edge-fleet"
    with tmpfs(tmp_path / "small", "64k") as mnt:
        target = mnt / "out"
        target.write_text("the old file\n")
        fill(mnt, inodes=False)
        r = subprocess.run([*EDGE, *args, "-o", str(target)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 74 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"edge: error: {target}: cannot write it: ")
        assert target.read_text() == "the old file\n" and sorted(p.name for p in mnt.iterdir()) == ["filler", "out"]
