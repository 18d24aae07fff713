"""`/v1/embeddings` through a real `edge serve` (socket-activated by kit.PidOne): warmed before
READY, keyed like every route, and shown in the start report and `edge status`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from edge.timing import REPORT_NAME
from kit import EDGE, get, metric, post, write_config

KEY = "sk-" + "5e" * 16  # as `openssl rand -hex 16` makes one: long enough to be accepted


def test_the_embeddings_route_is_warmed_before_ready_and_reported(tmp_path: Path, tiny_gguf: Path, service) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"\nmetrics_auth = "open"',
                       extra_model="[models.embeddings]\nn_batch = 64\npooling = \"last\"")
    pid1 = service(cfg)
    report = json.loads((tmp_path / "state" / REPORT_NAME).read_text())
    floors = [s for s in report["warmup"] if s.get("floor")]
    assert [s["path"] for s in floors] == ["/v1/completions", "/v1/embeddings"]  # both answered before READY
    assert report["models"][0]["context"]["embeddings"]["pooling"] == "last"

    assert post(pid1.address, "/v1/embeddings", {"input": "Hello"})[0] == 401  # keyed like every route
    status, body = _keyed_post(pid1.address, {"input": ["Hello", "world"]})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
    # /metrics is open to scrapers here (metrics_auth), the route keyed; the warm-up's not counted
    assert metric(pid1.address, "edge_embedding_inputs_total", model="tiny") == 2
    status, models = get(pid1.address, "/v1/models")
    assert status == 401
    env = {"EDGE_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([*EDGE, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60, env=env)
    assert "model tiny embeddings: last pooling (configured), n_batch 64, 64 dimensions, normalized" in out.stdout


def _keyed_post(address: tuple[str, int], body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        conn.request("POST", "/v1/embeddings", json.dumps(body), {"Authorization": f"Bearer {KEY}",
                                                                  "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()
