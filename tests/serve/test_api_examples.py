"""docs/api-examples.md as a reader follows it: the page's config (the embedded Gemma 3 270M and
the demo engine) served by a real `edge serve`, the engine built by the page's own command, and
every request of the page (curl, the `openai` client) run as written; each answer has the shape
the page shows (kit.examples). `EDGE_WRITE_EXAMPLES=1` writes the answers got into the page
instead of comparing (after an API change: then read the diff)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit import EDGE, PidOne
from kit.examples import examples, page_commands, page_config, run, same, write_answers

pytestmark = pytest.mark.gemma
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "api-examples.md"
WRITE = os.environ.get("EDGE_WRITE_EXAMPLES") == "1"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PidOne]:
    pytest.importorskip("onnxruntime")
    d = tmp_path_factory.mktemp("api-examples")
    cfg = page_config(PAGE, d)
    commands = page_commands(PAGE, cfg, EDGE)
    assert [c[len(EDGE)] for c in commands] == ["build-engine"]
    for argv in commands:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=300)
        yield pid1
        assert pid1.stop() == 0


def test_every_route_has_an_example_and_each_runs_as_shown(served: PidOne) -> None:
    found = examples(PAGE)
    routes = {m for e in found for m in re.findall(r"8088(/[\w/]+)", e.request)}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v2/models/mlp", "/v2/models/mlp/infer",
            "/v2/health/ready", "/healthz", "/readyz"} <= routes
    features = " ".join(e.request for e in found)
    for feature in ('"stream": true', '"logprobs"', '"json_schema"', '"tools"', "base_url=", "stream=True"):
        assert feature in features, feature
    answers = [(e, run(e, served.address)) for e in found]
    if WRITE:
        write_answers(PAGE, answers)
    for example, got in answers:
        same(examples(PAGE)[found.index(example)] if WRITE else example, got)
    chat = next(got for e, got in answers if e.kind == "python" and "chat.completions" in e.request)
    assert "Paris" in chat  # the page's question, answered: the client reached the model
