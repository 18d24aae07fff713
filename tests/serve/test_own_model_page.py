"""docs/own-model.md as a reader follows it: "your model" is a GGUF without a chat template (the
embedded Gemma 3 270M's own file, copied where the page puts it), served with the page's config
(added first, the embedded model beside it) by a real `edge serve`; every request of the page is
run as written and its answer has the shape shown (kit.examples). The same model replacing the
embedded one and without `chat_template` answers chat with the page's 400, word for word. The KV
sizes of the page's table are what edge's own estimate (`edge doctor`, the memory guard) gives
for those models' shapes. `EDGE_WRITE_EXAMPLES=1` writes the answers got into the page."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.config import ModelConfig, parse_config
from edge.model.gguf import GGUFInfo
from edge.model.memory import kv_bytes
from kit import EDGE, PidOne, post
from kit.examples import blocks, examples, page_config, run, same, write_answers

pytestmark = pytest.mark.gemma
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "own-model.md"
WRITE = os.environ.get("EDGE_WRITE_EXAMPLES") == "1"


@pytest.fixture(scope="module")
def mine(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> Path:
    """A GGUF without a chat template, where step 1 puts it (a tmp folder standing for /opt/models)."""
    d = tmp_path_factory.mktemp("models")
    shutil.copyfile(gemma_path, d / "my-model.gguf")
    (d / "my-model.gguf").chmod(0o644)
    return d / "my-model.gguf"


def _serve(cfg: Path) -> PidOne:
    pid1 = PidOne([*EDGE, "serve", "--config", str(cfg)])
    pid1.start()
    pid1.wait_for("READY", "1", timeout=300)
    return pid1


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, mine: Path) -> Iterator[PidOne]:
    cfg = page_config(PAGE, tmp_path_factory.mktemp("own-model"), {"/opt/models/my-model.gguf": str(mine)})
    names = [m.name for m in parse_config(cfg.read_text()).models]
    assert names == ["my-model", "gemma3-270m"]  # added first: the default
    with _serve(cfg) as pid1:
        yield pid1
        assert pid1.stop() == 0


def test_every_request_of_the_page_runs_as_shown(served: PidOne) -> None:
    found = examples(PAGE)
    kinds = " ".join(e.request for e in found)
    assert '"model": "my-model"' in kinds and '"model": "gemma3-270m"' in kinds and "base_url=" in kinds
    answers = [(e, run(e, served.address)) for e in found]
    if WRITE:
        write_answers(PAGE, answers)
    for example, got in answers:
        same(examples(PAGE)[found.index(example)] if WRITE else example, got)
    first = json.loads(answers[0][1])
    assert '"model"' not in found[0].request and first["model"] == "my-model"  # no "model": the first table
    assert "Paris" in next(got for e, got in answers if e.kind == "python")


def test_replaced_and_without_a_chat_template_chat_is_the_pages_400(tmp_path: Path, mine: Path) -> None:
    """The "replace" way (my-model the only table) with the chat_template line left out."""
    (toml,) = [text for lang, text in blocks(PAGE) if lang == "toml"]
    table = toml.split("[[models]]")[1]
    mine_only = re.sub(r"^# .*\n|^chat_template = '''.*?'''\n", "", table, flags=re.M | re.S)
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n[[models]]'
                   + mine_only.replace("/opt/models/my-model.gguf", str(mine)))
    assert "chat_template" not in cfg.read_text()
    shown = next(json.loads(text) for lang, text in blocks(PAGE) if lang == "json" and "no chat template" in text)
    with _serve(cfg) as pid1:
        status, body = post(pid1.address, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
        assert status == 400 and body == shown
        status, body = post(pid1.address, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200 and body["model"] == "my-model"  # no "model": the only table


def _mib_per_1024(layers: int, kv_heads: int, head: int) -> float:
    meta = {"llama.block_count": layers, "llama.attention.head_count": 32, "llama.attention.head_count_kv": kv_heads,
            "llama.attention.key_length": head, "llama.attention.value_length": head,
            "general.architecture": "llama"}
    info = GGUFInfo(path="shape-only", size=0, version=3, tensor_count=0, data_offset=0, data_bytes=0, metadata=meta)
    return kv_bytes(ModelConfig(name="m", path=info.path), info, 1024) / 2**20


def test_the_kv_sizes_of_the_table_are_edges_own_estimate(gemma_path: Path) -> None:
    from edge.model.gguf import read_gguf_info

    table = PAGE.read_text().split("| model (Q4_K_M file) |")[1].split("\n\n")[0]
    assert "| 112 MiB (Llama: 28 layers, 8 KV heads of 128) |" in table and _mib_per_1024(28, 8, 128) == 112
    assert "| 128 MiB (Llama: 32 layers, 8 KV heads of 128) |" in table and _mib_per_1024(32, 8, 128) == 128
    gemma = kv_bytes(ModelConfig(name="g", path=str(gemma_path)), read_gguf_info(gemma_path), 1024) / 2**20
    assert f"| {gemma:.0f} MiB (edge's estimate" in table
