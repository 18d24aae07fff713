from pathlib import Path

import pytest

from edge.device import SOC_SM, detect, sm_for_soc

FIX = Path(__file__).parent / "fixtures" / "devices"


def no_gpu() -> None:
    return None  # test double at the hardware boundary: no GPU to query


@pytest.mark.parametrize("tree, model, soc, sm, l4t, cuda", [
    ("orin-agx", "NVIDIA Jetson AGX Orin Developer Kit", "tegra234", "sm_87", "36.3.0", "12.6"),
    ("xavier-nx", "NVIDIA Jetson Xavier NX Developer Kit", "tegra194", "sm_72", "35.4.1", "11.4"),
    ("nano", "NVIDIA Jetson Nano Developer Kit", "tegra210", "sm_53", "32.7.4", "10.2"),
])
def test_jetson_trees(tree, model, soc, sm, l4t, cuda) -> None:
    d = detect(FIX / tree, gpu_query=no_gpu, cpu_arch="aarch64")
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.l4t_release, d.cuda) == \
        (model, soc, sm, "soc-table", l4t, cuda)
    assert d.cpu_arch == "aarch64"


def test_dgpu_tree_uses_the_gpu_query() -> None:
    d = detect(FIX / "dgpu-x86", gpu_query=lambda: "sm_89", cpu_arch="x86_64")
    assert (d.jetson_model, d.soc, d.sm, d.sm_source, d.cuda) == (None, None, "sm_89", "gpu", "13.0")
    assert detect(FIX / "dgpu-x86", gpu_query=no_gpu).sm is None


def test_a_queried_gpu_wins_over_the_table() -> None:
    assert detect(FIX / "orin-agx", gpu_query=lambda: "sm_87").sm_source == "gpu"


def test_soc_table() -> None:
    assert SOC_SM["tegra264"] == "sm_110" and SOC_SM["tegra186"] == "sm_62"
    assert sm_for_soc(["nvidia,p3768-0000", "nvidia,tegra234"]) == ("tegra234", "sm_87")
    assert sm_for_soc(["raspberrypi,4"]) == (None, None)


def test_empty_root_detects_nothing_but_the_cpu(tmp_path: Path) -> None:
    d = detect(tmp_path, gpu_query=no_gpu)
    assert (d.jetson_model, d.sm, d.cuda, d.l4t_release) == (None, None, None, None)
    assert d.cpu_arch
