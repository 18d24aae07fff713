"""A process's own start loads its models with llama.cpp's log in memory (edge.model.nativelog.quiet_load):
nothing of it reaches stderr, its error lines are logged once and name a failed load's reason, and
edge's callback is back afterwards."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from edge.model.llm import settings_for
from edge.model.native import Native


def _settings(path: Path):
    from edge.config import ModelConfig
    from edge.model.memory import context_plan

    cfg = ModelConfig(name="t", path=str(path), n_ctx=256, n_threads=1)
    return settings_for(cfg, context_plan(cfg, None))


def test_a_quiet_load_writes_nothing_and_leaves_the_callback(tiny_gguf: Path, capfd: pytest.CaptureFixture) -> None:
    quiet = Native(str(tiny_gguf), _settings(tiny_gguf), quiet=True)
    quiet.close()
    assert capfd.readouterr().err == ""  # ~1,500 lines of a load, none on stderr
    loud = Native(str(tiny_gguf), _settings(tiny_gguf))  # through edge's callback again: errors only
    loud.close()
    assert capfd.readouterr().err == ""


def test_a_quiet_load_that_fails_names_llama_cpps_reason(tmp_path: Path, tiny_gguf: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    data = tiny_gguf.read_bytes()
    key = b"general.architecture" + (8).to_bytes(4, "little") + (5).to_bytes(8, "little") + b"llama"
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(data.replace(key, key[:-5] + b"zzzzz"))
    with caplog.at_level(logging.ERROR, logger="edge.native"), pytest.raises(ValueError) as err:
        Native(str(foreign), _settings(foreign), quiet=True)
    assert "zzzzz" in str(err.value)  # llama.cpp's own words, from the captured log
    assert any("llama.cpp:" in r.getMessage() and "zzzzz" in r.getMessage() for r in caplog.records)
