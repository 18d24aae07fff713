"""Zero refused connections across restarts: what PID 1 does with edge.socket, done by the
harness, under 8 client threads that never stop sending."""

from __future__ import annotations

import json
from pathlib import Path

from kit import ClientLoad, metric, write_config


def test_two_restarts_under_load_refuse_nothing(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()

    def correct(status: int, raw: bytes) -> bool:
        if status != 200:
            return False
        answer = json.loads(raw)
        return answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] >= 1

    pid1 = service(cfg)
    load = ClientLoad(pid1.address, body, clients=8, max_seconds=120, check=correct).start()
    pids = [pid1.proc.pid]
    load.wait_ok(20)  # serving under load before the first restart
    for _ in range(2):
        assert pid1.stop() == 0  # SIGTERM: drain, exit 0
        gone = load.result.ok  # the old process has exited: later answers are the new one's
        pid1.start()  # same listening socket, new process
        pids.append(pid1.proc.pid)
        pid1.wait_for("READY", "1")
        load.wait_ok(gone + 20)
        # The new process counted client requests of its own (its counters start at zero).
        served = metric(pid1.address, "edge_requests_total", route="/v1/completions", status="200")
        assert served >= 20
    result = load.stop()
    assert pid1.stop() == 0
    print(f"\nrestart under load: {result.ok} ok, {result.refused} refused, {result.errors} errors, "
          f"longest wait {result.longest_s:.3f} s, pids {pids}")
    assert result.refused == 0, result.error_samples
    assert result.errors == 0, result.error_samples
    assert result.ok > 50
    assert len(set(pids)) == 3
