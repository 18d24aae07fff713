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


def test_models_load_with_a_short_switch_interval_then_it_is_restored() -> None:
    """llama.cpp's log callback takes the GIL at every line of a load: while the HTTP stack is
    imported beside it, the switch interval is short (LOAD_SWITCH_INTERVAL_S), and restored after."""
    import sys
    import types

    from edge.lifecycle.loader import LOAD_SWITCH_INTERVAL_S, Loader

    seen: dict[str, float] = {}
    stub = types.SimpleNamespace(
        at_start=False, load_models=lambda files, made: seen.setdefault("load", sys.getswitchinterval()) and ({}, {}),
        import_http=lambda: seen.setdefault("imports", sys.getswitchinterval()))
    before = sys.getswitchinterval()
    assert Loader.load_models_beside_http(stub, [], {}) == ({}, {})
    assert seen == pytest.approx({"load": LOAD_SWITCH_INTERVAL_S, "imports": LOAD_SWITCH_INTERVAL_S})
    assert LOAD_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before

    def failing(files: object, made: object) -> None:
        raise RuntimeError("load failed")

    with pytest.raises(RuntimeError):
        Loader.load_models_beside_http(types.SimpleNamespace(at_start=True, load_models=failing,
                                                             import_http=lambda: None), [], {})
    assert sys.getswitchinterval() == before
