"""Zero refused connections across restarts: what PID 1 does with edge.socket, done by the
harness, under 8 client threads that never stop sending."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import EDGE, write_config
from edge.harness import ClientLoad, PidOne


def test_two_restarts_under_load_refuse_nothing(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()

    def correct(status: int, raw: bytes) -> bool:
        if status != 200:
            return False
        answer = json.loads(raw)
        return answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] >= 1

    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        load = ClientLoad(pid1.address, body, clients=8, max_seconds=120, check=correct).start()
        pids = [pid1.proc.pid]
        for _ in range(2):
            time.sleep(1.0)
            before = load.result.ok
            assert pid1.stop() == 0  # SIGTERM: drain, exit 0
            pid1.start()  # same listening socket, new process
            pids.append(pid1.proc.pid)
            pid1.wait_for("READY", "1")
            assert load.result.ok > before
        time.sleep(1.0)
        result = load.stop()
        assert pid1.stop() == 0
    print(f"\nrestart under load: {result.ok} ok, {result.refused} refused, {result.errors} errors, "
          f"longest wait {result.longest_s:.3f} s, pids {pids}")
    assert result.refused == 0, result.error_samples
    assert result.errors == 0, result.error_samples
    assert result.ok > 50
    assert len(set(pids)) == 3
