"""Reloads that keep the model while 8 clients send requests without a pause (the short form of
`scripts/bench soak_reload`): no request fails and llama.cpp never reports a decode error (issue 51:
a reload that keeps a model must not put a second scheduler on it)."""

from __future__ import annotations

from pathlib import Path

from kit import write_config
from harness.soak import answers, reload_soak

REQUEST = {"prompt": "Hello world", "max_tokens": 24, "temperature": 0.8}


def test_reloads_that_keep_the_model_under_load_fail_nothing(tmp_path: Path, tiny_gguf: Path, service) -> None:
    # two configs that differ in a server setting only: every reload keeps the model and its worker
    configs = tuple(write_config(tmp_path / f"{name}.toml", tiny_gguf, extra_model="parallel = 4",
                                 server=f"max_queue = {queue}") for name, queue in (("a", 64), ("b", 65)))
    pid1 = service(configs[0])
    got = reload_soak(pid1.address, configs, pid1.log_path, REQUEST, clients=8, pace=answers(16, rounds=4))
    assert len(got.reloads) == 4 and all(r["rc"] == 0 and r["kept"] for r in got.reloads), got.reloads
    assert got.failed == 0 and got.ok >= 4 * 16, got.samples
    assert got.decode_errors == []
    assert pid1.stop() == 0
