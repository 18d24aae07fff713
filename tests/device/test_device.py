from pathlib import Path

import pytest

from edge.device.identity import SOC_SM, GpuInfo, GpuProbe, detect, probe_gpu, sm_for_soc, tensorrt_version
from fakecuda import H100 as H100_DRIVER, FakeGpu

FIX = Path(__file__).parents[1] / "fixtures" / "devices"


# test doubles at the hardware/software boundary: what the GPU, TensorRT and pip would say
def no_gpu() -> GpuProbe:
    return GpuProbe(None, None, "no cuda-python here")


def no_trt() -> None:
    return None


def no_dists(names: tuple) -> None:
    return None


ORIN = GpuProbe(GpuInfo(name="Orin", sm="sm_87", integrated=True), "12.6")
H100 = GpuProbe(GpuInfo(name="NVIDIA H100 80GB HBM3", sm="sm_90"), "13.0")


@pytest.mark.parametrize("tree, model, soc, sm, l4t, cuda, platform, board", [
    ("orin-agx", "NVIDIA Jetson AGX Orin Developer Kit", "tegra234", "sm_87", "36.3.0", "12.6", "jetson-p3701-0005",
     "jetson-agx-orin"),
    ("orin-nano-jp6", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", "tegra234", "sm_87",
     "36.4.3", None, "jetson-p3767-0005", "jetson-orin-nano-engineering-reference-super"),
    ("orin-nano-devkit", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit", "tegra234", "sm_87",
     "36.3.0", None, "jetson-p3767-0005", "jetson-orin-nano-engineering-reference"),
    # a Xavier NX lists no module entry: the module half of "carrier+module"
    ("xavier-nx", "NVIDIA Jetson Xavier NX Developer Kit", "tegra194", "sm_72", "35.4.1", "11.4", "jetson-p3668-0001",
     "jetson-xavier-nx"),
    ("nano", "NVIDIA Jetson Nano Developer Kit", "tegra210", "sm_53", "32.7.4", "10.2", "jetson-p3450-0000",
     "jetson-nano"),
])
def test_jetson_trees(tree, model, soc, sm, l4t, cuda, platform, board) -> None:
    d = detect(FIX / tree, gpu=no_gpu, cpu_arch="aarch64", trt=no_trt, dists=no_dists)
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.l4t_release, d.cuda, d.platform, d.board) == \
        (model, soc, sm, "soc-table", l4t, cuda, platform, board)
    assert d.cpu_arch == "aarch64" and d.as_dict()["board"] == board


def test_jetpack6_runtime_only_asks_the_driver() -> None:
    # L4T r36 without the CUDA toolkit: no version.json, no runtime found, the driver's answer is used
    d = detect(FIX / "orin-nano-jp6", gpu=lambda: ORIN, trt=lambda: "10.3.0", dists=no_dists)
    assert (d.cuda, d.cuda_source, d.sm_source, d.gpu_name, d.tensorrt) == ("12.6", "driver", "gpu", "Orin", "10.3.0")
    assert (d.cuda_driver, d.cuda_runtimes, d.unified_memory, d.gpu_integrated) == ("12.6", (), True, True)
    # the module, not the GPU's name, tells Orins apart
    assert d.platform == "jetson-p3767-0005"
    assert detect(FIX / "orin-agx", gpu=lambda: ORIN, dists=no_dists).platform == "jetson-p3701-0005"


def test_pip_assembled_cuda() -> None:
    versions = {"nvidia-cuda-runtime-cu12": "12.8.57"}
    dists = lambda names: next((versions[n] for n in names if n in versions), None)  # noqa: E731
    d = detect(FIX / "dgpu-pip-x86", gpu=no_gpu, trt=no_trt, dists=dists)
    assert (d.cuda, d.cuda_source) == ("12.8", "pip nvidia-cuda-runtime-cu12 12.8.57")
    d = detect(FIX / "dgpu-pip-x86", gpu=lambda: H100, trt=no_trt, dists=dists, cpu_arch="x86_64")
    assert (d.cuda, d.cuda_driver, d.platform, d.sm) == ("12.8", "13.0", "x86-64-nvidia-h100-80gb-hbm3", "sm_90")
    assert d.as_dict()["cuda_runtimes"] == [{"version": "12.8", "source": "pip nvidia-cuda-runtime-cu12 12.8.57"}]
    assert d.unified_memory is False
    gh200 = detect(FIX / "dgpu-pip-x86", gpu=lambda: H100, trt=no_trt, dists=dists, cpu_arch="aarch64")
    assert gh200.platform == "aarch64-nvidia-h100-80gb-hbm3"  # same GPU, another host platform
    assert detect(FIX / "dgpu-pip-x86", gpu=lambda: H100, dists=no_dists).cuda_source == "driver"
    assert detect(FIX / "dgpu-pip-x86", gpu=no_gpu, dists=no_dists).cuda is None  # unknown, not an error


def test_the_key_cuda_is_the_runtime_tensorrt_links_not_the_first_found() -> None:
    """A tensorrt-cu12 wheel on a host whose toolkit is CUDA 13: TensorRT runs on the CUDA 12
    runtime it preloads, so that is the key's CUDA, not /usr/local/cuda's 13.0."""
    h100 = GpuProbe(GpuInfo(name="NVIDIA H100 80GB HBM3", sm="sm_90"), "13.0")
    wheel = dists_of({"tensorrt-cu12": "10.13.3.9", "nvidia-cuda-runtime-cu12": "12.9.79"})
    d = detect(FIX / "dgpu-x86", gpu=lambda: h100, dists=wheel)
    assert (d.cuda, d.cuda_source) == ("12.9", "pip nvidia-cuda-runtime-cu12 12.9.79")
    assert [s for _, s in d.cuda_runtimes] == ["/usr/local/cuda/version.json", "pip nvidia-cuda-runtime-cu12 12.9.79"]
    bare = detect(FIX / "dgpu-x86", gpu=lambda: h100, dists=dists_of({"tensorrt-cu12-bindings": "10.13.3.9"}))
    assert (bare.cuda, bare.cuda_source) == ("12", "pip tensorrt-cu12-bindings 10.13.3.9 (links CUDA 12)")
    # JetPack: the system TensorRT links the toolkit's runtime, not a stray pip wheel found too
    stray = detect(FIX / "orin-agx", gpu=lambda: ORIN, dists=dists_of({"nvidia-cuda-runtime-cu12": "12.9.79"}))
    assert (stray.cuda, stray.cuda_source) == ("12.6", "/usr/local/cuda/version.json")


def dists_of(versions: dict[str, str]):
    return lambda names: next((versions[n] for n in names if n in versions), None)  # test double: pip


def test_dgpu_tree_uses_the_gpu_query() -> None:
    g = GpuProbe(GpuInfo(name="NVIDIA GeForce RTX 4090", sm="sm_89"), "13.0")
    d = detect(FIX / "dgpu-x86", gpu=lambda: g, cpu_arch="x86_64", dists=no_dists)
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.cuda, d.cuda_source) == \
        (None, None, "sm_89", "gpu", "13.0", "/usr/local/cuda/version.json")
    assert detect(FIX / "dgpu-x86", gpu=no_gpu).sm is None


def test_a_queried_gpu_wins_over_the_table() -> None:
    assert detect(FIX / "orin-agx", gpu=lambda: ORIN).sm_source == "gpu"


def test_soc_table() -> None:
    assert SOC_SM["tegra264"] == "sm_110" and SOC_SM["tegra186"] == "sm_62"
    assert sm_for_soc(["nvidia,p3768-0000", "nvidia,tegra234"]) == ("tegra234", "sm_87")
    assert sm_for_soc(["raspberrypi,4"]) == (None, None)


def test_empty_root_detects_nothing_but_the_cpu(tmp_path: Path) -> None:
    d = detect(tmp_path, gpu=no_gpu, dists=no_dists)
    assert (d.jetson_model, d.sm, d.cuda, d.l4t_release, d.platform) == (None, None, None, None, None)
    assert d.cpu_arch


def test_tensorrt_version_is_read_from_the_module_without_importing_it(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "tensorrt"
    pkg.mkdir()
    # the shape of TensorRT's own __init__.py; importing it would fail here
    (pkg / "__init__.py").write_text('import ctypes\nraise ImportError("no libnvinfer")\n'
                                     'from .tensorrt import *\n__version__ = "10.13.3.9"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tensorrt", raising=False)
    assert tensorrt_version() == "10.13.3.9"
    assert "tensorrt" not in __import__("sys").modules


def test_probe_through_the_driver_api() -> None:
    """probe_gpu over the driver double (tests/fakecuda.py): the query functions the real
    driver answers, and the reason when cuInit fails (the driver's version is known even then)."""
    p = probe_gpu(FakeGpu().driver)
    assert p.gpu == GpuInfo(name="Orin", sm="sm_87", integrated=True, total_bytes=64 << 30) and p.driver == "12.6"
    p = probe_gpu(FakeGpu(H100_DRIVER).driver)
    assert (p.gpu.sm, p.gpu.integrated, p.driver) == ("sm_90", False, "13.0")
    p = probe_gpu(FakeGpu(fail={"cuInit": "CUDA_ERROR_NOT_SUPPORTED"}).driver)
    assert p.gpu is None and p.driver == "12.6" and "cuInit failed: CUDA_ERROR_NOT_SUPPORTED" in p.error


def test_probe_with_the_real_cuda_python_and_no_driver_says_why() -> None:
    p = probe_gpu()
    if p.gpu is not None:
        pytest.skip("this machine has a GPU")
    assert "libcuda.so.1 cannot be loaded" in p.error and p.driver is None
    d = detect(gpu=lambda: p)
    assert d.gpu_error == p.error and d.as_dict()["gpu_error"] == p.error


def test_a_lean_only_install_reports_the_lean_modules_version(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "tensorrt_lean"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise ImportError("no libnvinfer_lean")\n__version__ = "10.3.0.30"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("tensorrt", "tensorrt_lean"):
        monkeypatch.delitem(__import__("sys").modules, m, raising=False)
    assert tensorrt_version() == "10.3.0.30"


def test_unified_memory_has_one_source_and_an_igx_dgpu_is_a_dgpu() -> None:
    """DeviceInfo.unified_memory and memory.unified_memory() answer alike for every tree and
    driver answer; on an IGX board (a Jetson module's tree) whose CUDA device 0 is a dGPU, both
    say discrete memory, and the engine key is that dGPU's, not the module's with the dGPU's SM."""
    from edge.device.memory import unified_memory
    from edge.engines.key import host_platform

    a6000 = GpuProbe(GpuInfo("NVIDIA RTX A6000", "sm_86", integrated=False), "12.6")
    answers = {"integrated": ORIN, "discrete": a6000, "no driver": GpuProbe(None, None, "no libcuda")}
    for tree in ("orin-agx", "orin-nano-jp6", "dgpu-x86", "dgpu-pip-x86"):
        for what, probe in answers.items():
            d = detect(FIX / tree, gpu=lambda: probe, cpu_arch="aarch64", trt=no_trt, dists=no_dists)
            said = probe.gpu.integrated if probe.gpu else None
            assert d.unified_memory == unified_memory(FIX / tree, integrated=lambda: said), (tree, what)
    igx = detect(FIX / "orin-agx", gpu=lambda: a6000, cpu_arch="aarch64", trt=no_trt, dists=no_dists)
    assert igx.jetson and not igx.unified_memory and not igx.jetson_gpu
    assert (igx.platform, host_platform(igx), igx.sm) == ("aarch64-nvidia-rtx-a6000", "aarch64", "sm_86")
    orin = detect(FIX / "orin-agx", gpu=lambda: ORIN, cpu_arch="aarch64", trt=no_trt, dists=no_dists)
    assert (orin.platform, host_platform(orin), orin.unified_memory) == ("jetson-p3701-0005", "jetson", True)
