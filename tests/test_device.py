from pathlib import Path

import pytest

from edge.device import SOC_SM, GpuInfo, detect, sm_for_soc, tensorrt_version

FIX = Path(__file__).parent / "fixtures" / "devices"


# test doubles at the hardware/software boundary: what the GPU, TensorRT and pip would say
def no_gpu() -> None:
    return None


def no_trt() -> None:
    return None


def no_dists(names: tuple) -> None:
    return None


ORIN = GpuInfo(name="Orin", sm="sm_87", cuda_runtime="12.6", cuda_driver="12.6")
H100 = GpuInfo(name="NVIDIA H100 80GB HBM3", sm="sm_90", cuda_runtime="12.8", cuda_driver="13.0")


@pytest.mark.parametrize("tree, model, soc, sm, l4t, cuda, platform", [
    ("orin-agx", "NVIDIA Jetson AGX Orin Developer Kit", "tegra234", "sm_87", "36.3.0", "12.6", "jetson-agx-orin"),
    ("orin-nano-jp6", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", "tegra234", "sm_87",
     "36.4.3", None, "jetson-orin-nano-engineering-reference-super"),
    ("xavier-nx", "NVIDIA Jetson Xavier NX Developer Kit", "tegra194", "sm_72", "35.4.1", "11.4", "jetson-xavier-nx"),
    ("nano", "NVIDIA Jetson Nano Developer Kit", "tegra210", "sm_53", "32.7.4", "10.2", "jetson-nano"),
])
def test_jetson_trees(tree, model, soc, sm, l4t, cuda, platform) -> None:
    d = detect(FIX / tree, gpu=no_gpu, cpu_arch="aarch64", trt=no_trt, dists=no_dists)
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.l4t_release, d.cuda, d.platform) == \
        (model, soc, sm, "soc-table", l4t, cuda, platform)
    assert d.cpu_arch == "aarch64"


def test_jetpack6_runtime_only_asks_the_runtime() -> None:
    # L4T r36 without the CUDA toolkit: no version.json, the runtime's answer is used
    d = detect(FIX / "orin-nano-jp6", gpu=lambda: ORIN, trt=lambda: "10.3.0", dists=no_dists)
    assert (d.cuda, d.cuda_source, d.sm_source, d.gpu_name, d.tensorrt) == ("12.6", "cudart", "gpu", "Orin", "10.3.0")
    # the module, not the GPU's name, tells Orins apart
    assert d.platform == "jetson-orin-nano-engineering-reference-super"
    assert detect(FIX / "orin-agx", gpu=lambda: ORIN, dists=no_dists).platform == "jetson-agx-orin"


def test_pip_assembled_cuda() -> None:
    versions = {"nvidia-cuda-runtime-cu12": "12.8.57"}
    dists = lambda names: next((versions[n] for n in names if n in versions), None)  # noqa: E731
    d = detect(FIX / "dgpu-pip-x86", gpu=no_gpu, trt=no_trt, dists=dists)
    assert (d.cuda, d.cuda_source) == ("12.8", "pip")
    d = detect(FIX / "dgpu-pip-x86", gpu=lambda: H100, trt=no_trt, dists=dists, cpu_arch="x86_64")
    assert (d.cuda, d.cuda_source, d.platform, d.sm) == ("12.8", "cudart", "x86-64-nvidia-h100-80gb-hbm3", "sm_90")
    gh200 = detect(FIX / "dgpu-pip-x86", gpu=lambda: H100, trt=no_trt, dists=dists, cpu_arch="aarch64")
    assert gh200.platform == "aarch64-nvidia-h100-80gb-hbm3"  # same GPU, another host platform
    no_runtime = GpuInfo(name="NVIDIA H100 80GB HBM3", sm="sm_90", cuda_runtime=None, cuda_driver="13.0")
    assert detect(FIX / "dgpu-pip-x86", gpu=lambda: no_runtime, dists=no_dists).cuda_source == "driver"
    assert detect(FIX / "dgpu-pip-x86", gpu=no_gpu, dists=no_dists).cuda is None  # unknown, not an error


def test_dgpu_tree_uses_the_gpu_query() -> None:
    g = GpuInfo(name="NVIDIA GeForce RTX 4090", sm="sm_89")
    d = detect(FIX / "dgpu-x86", gpu=lambda: g, cpu_arch="x86_64", dists=no_dists)
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.cuda, d.cuda_source) == \
        (None, None, "sm_89", "gpu", "13.0", "version.json")
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
