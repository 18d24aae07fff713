"""mlock really verified: with RLIMIT_MEMLOCK too low (and CAP_IPC_LOCK dropped, since root
ignores the limit otherwise) the service says so, with the limit and the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kit import EDGE, PidOne, write_config

LIMITED = ["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set=-ipc_lock",
           "--inh-caps=-ipc_lock"]

pytestmark = pytest.mark.skipif(not (shutil.which("prlimit") and shutil.which("setpriv")),
                                reason="needs util-linux prlimit and setpriv")


def test_required_mlock_that_does_not_take_exits_77(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="require_mlock = true")
    p = subprocess.run([*LIMITED, *EDGE, "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 77, p.stderr
    assert "mlock did not take" in p.stderr
    assert "RLIMIT_MEMLOCK is 0.1 MiB" in p.stderr and "LimitMEMLOCK=infinity" in p.stderr


def test_optional_mlock_warns_serves_and_reports_it(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    with PidOne([*LIMITED, *EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        # prlimit and setpriv exec in turn, so the service keeps the shell's pid
        pid1.wait_for("READY", "1")
        assert "mlock did not take" in pid1.log_tail(5000)
        report = json.loads((tmp_path / "state" / "last-start.json").read_text())
        mlock = next(p for p in report["phases"] if p["name"] == "mlock_verify")["detail"]
        assert mlock["ok"] is False and mlock["limit_bytes"] == 65536 and mlock["cap_ipc_lock"] is False
        assert mlock["locked_bytes"] < mlock["expected_bytes"]
        assert pid1.stop() == 0


def test_mlock_takes_when_allowed(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="require_mlock = true")
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        report = json.loads((tmp_path / "state" / "last-start.json").read_text())
        mlock = next(p for p in report["phases"] if p["name"] == "mlock_verify")["detail"]
        assert mlock["ok"] is True and mlock["locked_bytes"] >= mlock["expected_bytes"]
        assert pid1.stop() == 0
