"""llama.cpp GPU offload: n_gpu_layers > 0 without a GPU is refused, telling a CPU-only build
(rebuild) from a CUDA build whose device did not start (the driver's reason)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from edge.errors import EX_CONFIG, GpuOffloadUnavailable
from edge.model.gpu import llama_build, require_gpu_offload


def fake_llama_cpp(offload: bool) -> types.SimpleNamespace:
    # test double for the llama_cpp module: only the question edge asks it
    return types.SimpleNamespace(llama_supports_gpu_offload=lambda: offload)


def cpu_build() -> str:
    return "cpu"


def cuda_build() -> str:
    return "cuda"


def test_cpu_only_build_with_gpu_layers_is_refused_with_the_fix() -> None:
    with pytest.raises(GpuOffloadUnavailable) as info:
        require_gpu_offload(fake_llama_cpp(False), "gemma", 99, build=cpu_build)
    msg = str(info.value)
    assert "'gemma'" in msg and "n_gpu_layers = 99" in msg and "CPU-only build" in msg
    assert 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87"' in msg and "--no-cache-dir" in msg
    assert info.value.exit_code == EX_CONFIG  # the unit stops instead of restarting forever


def test_a_cuda_build_whose_device_did_not_start_says_the_drivers_reason() -> None:
    from fakecuda import FakeGpu

    from edge.device.identity import probe_gpu

    # what the driver says on a JetPack 6 unit without the render node (the driver double)
    closed = probe_gpu(FakeGpu(fail={"cuInit": "CUDA_ERROR_NOT_SUPPORTED"}).driver)
    with pytest.raises(GpuOffloadUnavailable) as info:
        require_gpu_offload(fake_llama_cpp(False), "gemma", 99, build=cuda_build, gpu_error=lambda: closed.error)
    msg = str(info.value)
    assert "is a CUDA build, but its CUDA device did not start" in msg and "CPU-only" not in msg
    assert "cuInit failed: CUDA_ERROR_NOT_SUPPORTED" in msg and "/dev/dri/renderD*" in msg
    assert info.value.exit_code == EX_CONFIG


def test_offload_allowed_when_a_gpu_is_registered_or_not_asked() -> None:
    require_gpu_offload(fake_llama_cpp(True), "gemma", 99, build=cpu_build)
    require_gpu_offload(fake_llama_cpp(False), "gemma", 0, build=cpu_build)
    with pytest.raises(GpuOffloadUnavailable):  # an old llama_cpp without the function: no proof
        require_gpu_offload(types.SimpleNamespace(), "gemma", -1, build=cpu_build)


def test_llama_build_from_the_shipped_libraries(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"")
    (lib / "libggml-cpu.so").write_bytes(b"")
    assert llama_build(tmp_path) == "cpu"
    (lib / "libllama.so").write_bytes(b"\x7fELF...ggml_backend_cuda_reg\0...")  # ggml linked in statically
    assert llama_build(tmp_path) == "cuda"
    (lib / "libllama.so").write_bytes(b"")
    (lib / "libggml-cuda.so").write_bytes(b"")
    assert llama_build(tmp_path) == "cuda"
    assert llama_build(tmp_path / "absent") is None


def test_the_installed_llama_cpp_is_told_by_its_libraries() -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    build = llama_build()
    assert build == ("cuda" if llama_cpp.llama_supports_gpu_offload() else build)
    if not llama_cpp.llama_supports_gpu_offload():  # here: no GPU; a CPU-only build has no CUDA symbol
        libs = Path(llama_cpp.__file__).parent / "lib"
        assert build == ("cuda" if list(libs.glob("libggml-cuda*")) else "cpu")


def _cuda_build() -> bool:
    try:
        import llama_cpp
    except ImportError:
        return True  # nothing to test the refusal with
    return bool(llama_cpp.llama_supports_gpu_offload())


@pytest.mark.skipif(_cuda_build(), reason="needs llama-cpp-python's CPU-only build")
def test_serve_refuses_gpu_layers_on_a_cpu_build_and_doctor_says_so(tmp_path: Path, tiny_gguf: Path) -> None:
    import subprocess

    from edge.host.doctor import run_checks
    from kit import EDGE, write_config

    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="n_gpu_layers = 99")
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == EX_CONFIG and "CPU-only build" in r.stderr and "-DGGML_CUDA=on" in r.stderr
    assert "Traceback" not in r.stderr
    (check,) = [c for c in run_checks(str(cfg), []) if c.name == "gpu offload"]
    assert check.level == "fail" and "--no-cache-dir" in check.fix
