"""llama.cpp GPU offload: a CPU-only build with n_gpu_layers > 0 is refused, with the fix."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from edge.errors import EX_CONFIG
from edge.llama_gpu import GpuOffloadUnavailable, llama_build, require_gpu_offload


def fake_llama_cpp(offload: bool) -> types.SimpleNamespace:
    # test double for the llama_cpp module: only the question edge asks it
    return types.SimpleNamespace(llama_supports_gpu_offload=lambda: offload)


def test_cpu_only_build_with_gpu_layers_is_refused_with_the_fix() -> None:
    with pytest.raises(GpuOffloadUnavailable) as info:
        require_gpu_offload(fake_llama_cpp(False), "gemma", 99)
    msg = str(info.value)
    assert "'gemma'" in msg and "n_gpu_layers = 99" in msg and "CPU-only build" in msg
    assert 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87"' in msg and "--no-cache-dir" in msg
    assert info.value.exit_code == EX_CONFIG  # the unit stops instead of restarting forever


def test_offload_allowed_when_built_with_cuda_or_not_asked() -> None:
    require_gpu_offload(fake_llama_cpp(True), "gemma", 99)
    require_gpu_offload(fake_llama_cpp(False), "gemma", 0)
    with pytest.raises(GpuOffloadUnavailable):  # an old llama_cpp without the function: no proof
        require_gpu_offload(types.SimpleNamespace(), "gemma", -1)


def test_llama_build_from_the_shipped_libraries(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"")
    (lib / "libggml-cpu.so").write_bytes(b"")
    assert llama_build(tmp_path) == "cpu"
    (lib / "libggml-cuda.so").write_bytes(b"")
    assert llama_build(tmp_path) == "cuda"
    assert llama_build(tmp_path / "absent") is None


def _cuda_build() -> bool:
    try:
        import llama_cpp
    except ImportError:
        return True  # nothing to test the refusal with
    return bool(llama_cpp.llama_supports_gpu_offload())


@pytest.mark.skipif(_cuda_build(), reason="needs llama-cpp-python's CPU-only build")
def test_serve_refuses_gpu_layers_on_a_cpu_build_and_doctor_says_so(tmp_path: Path, tiny_gguf: Path) -> None:
    import subprocess

    from edge.doctor import run_checks
    from kit import EDGE, write_config

    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="n_gpu_layers = 99")
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == EX_CONFIG and "CPU-only build" in r.stderr and "-DGGML_CUDA=on" in r.stderr
    assert "Traceback" not in r.stderr
    (check,) = [c for c in run_checks(str(cfg), []) if c.name == "gpu offload"]
    assert check.level == "fail" and "--no-cache-dir" in check.fix
