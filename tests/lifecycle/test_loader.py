"""The load-and-warm step (edge.lifecycle.loader): what a load that fails half-way leaves behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import load_config
from edge.errors import ConfigError
from edge.lifecycle.loader import Loader
from edge.model.mlock import vm_locked_bytes
from edge.lifecycle.systemd import Notifier
from edge.timing import StartTimer
from kit import write_config


def test_a_load_that_fails_after_the_model_frees_the_model(tmp_path: Path, tiny_gguf: Path) -> None:
    """A declared prefix that cannot fit fails the load after llama.cpp loaded (and locked) the
    model: the model is closed again, its lock released, nothing left for a reload to leak."""
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=64, extra_model=(
        'use_mlock = true\n[[models.prefixes]]\nname = "long"\ntext = "' + "Hello world. " * 8 + '"\n'))
    before = vm_locked_bytes()
    notifier = Notifier()
    notifier.enabled = False
    with pytest.raises(ConfigError, match="prefixes"):
        Loader(load_config(cfg), StartTimer(), notifier).load()
    assert vm_locked_bytes() == before
