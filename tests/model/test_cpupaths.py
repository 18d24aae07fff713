"""llama.cpp's CPU paths: llama_print_system_info() parsed (this machine's real library, and an
ARM build's text), the AMX path edge leaves out and why (fixture /proc/cpuinfo trees), the
build record scripts/setup writes, a library that dies when loaded, and `edge device`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edge.model.cpupaths import (AMX_REASON, BUILD_RECORD, effective_args, libllama, llama_cpu,
                                 parse_system_info, read_build_record, record_build, system_info)
from kit import EDGE

FIX = Path(__file__).parents[1] / "fixtures" / "devices"
SPR_VM = FIX / "spr-vm"  # a virtualized Sapphire Rapids: amx_tile amx_int8, hypervisor
# llama_print_system_info() of an aarch64 CUDA build (an Orin: sm_87, NEON with dot products,
# weight repacking on), in the format of llama.cpp's src/llama.cpp and the feature names of
# ggml-cpu.cpp and ggml-cuda.cu
ARM_CUDA = ("CUDA : ARCHS = 870 | USE_GRAPHS = 1 | CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | "
            "DOTPROD = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
X86_NO_AMX = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | REPACK = 1 | "
X86_AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
# CMAKE_ARGS switch -> the feature llama_print_system_info() names for it
FLAG_FEATURE = {f"-DGGML_{n}": n for n in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512",
                                           "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")}


def says(text: str):
    """Test double of the library boundary: what llama_print_system_info() would return."""
    return lambda lib: (text, None)


def fake_install(tmp_path: Path, args: list[str], libs: dict[str, bytes]) -> tuple[Path, Path, Path]:
    """A keyed wheel dir as scripts/build-llama-wheel leaves it (wheel + cmake-args.txt), the
    llama_cpp package folder installed from it, and the venv prefix the record goes to."""
    keyed = tmp_path / "edge-llama" / "0123456789abcdef"
    keyed.mkdir(parents=True)
    wheel = keyed / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in libs.items():
            z.writestr(f"llama_cpp/lib/{name}", data)
        z.writestr("llama_cpp/__init__.py", "")
    (keyed / "cmake-args.txt").write_text("\n".join(args) + "\n")
    pkg = tmp_path / "site" / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    for name, data in libs.items():
        (pkg / "lib" / name).write_bytes(data)
    prefix = tmp_path / "venv"
    prefix.mkdir()
    return wheel, pkg, prefix


def test_parses_an_arm_cuda_build() -> None:
    backends = parse_system_info(ARM_CUDA)
    assert backends == {"CUDA": {"ARCHS": "870", "USE_GRAPHS": "1"},
                        "CPU": {"NEON": "1", "ARM_FMA": "1", "FP16_VA": "1", "DOTPROD": "1",
                                "LLAMAFILE": "1", "OPENMP": "1", "REPACK": "1"}}
    assert parse_system_info("") == {}


def test_this_machines_library_is_parsed_and_agrees_with_its_build_flags() -> None:
    lib = libllama()
    if lib is None:
        pytest.skip("llama-cpp-python is not installed")
    text, error = system_info(lib)
    assert error is None and "CPU : " in text, (text, error)
    cpu = parse_system_info(text)["CPU"]
    named = re.findall(r"(\w+) = (\S+) \|", text.split("CPU : ", 1)[1])  # the CPU backend's pairs, in order
    assert list(cpu.items()) == named and ("SSE3" in cpu or "NEON" in cpu), text
    record = read_build_record()
    if record is None or not record.current:
        pytest.skip("llama-cpp-python here was not installed by scripts/setup: no flags to compare")
    for arg in record.cmake_args:  # every switch the build names is a path the library has, or not
        switch, _, value = arg.partition("=")
        if switch in FLAG_FEATURE:
            assert (FLAG_FEATURE[switch] in cpu) == (value == "ON"), (arg, cpu)


def test_amx_on_the_cpu_but_left_out_of_the_build_says_why(tmp_path: Path) -> None:
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]
    wheel, pkg, prefix = fake_install(tmp_path, args, {"libllama.so": b"llama", "libggml-cpu.so": b"cpu"})
    record_build(wheel, prefix)
    found = llama_cpu(SPR_VM, pkg, says(X86_NO_AMX), prefix)
    assert found.turned_off == (("AMX", f"the CPU has amx_tile amx_int8, this build has no AMX path: {AMX_REASON}"),)
    assert AMX_REASON.startswith("left out by scripts/build-llama-wheel") and "EDGE_LLAMA_AMX=1" in AMX_REASON
    assert found.build is not None and found.build.key == "0123456789abcdef" and found.build.current
    assert not found.amx_risk and "turned off: AMX: the CPU has amx_tile amx_int8" in "\n".join(found.lines())
    # without AMX on the CPU nothing is turned off; without a record the reason says so
    assert llama_cpu(FIX / "dgpu-x86", pkg, says(X86_NO_AMX), prefix).turned_off == ()
    (prefix / BUILD_RECORD).unlink()
    bare = llama_cpu(SPR_VM, pkg, says(X86_NO_AMX), prefix)
    assert bare.turned_off[0][1].endswith("built without it (its build flags are not recorded here)")
    assert "build flags: not recorded" in bare.lines()[-1]


def test_a_build_with_amx_on_a_virtual_machine_is_a_risk() -> None:
    found = llama_cpu(SPR_VM, None, says(X86_AMX))
    assert found.amx_risk and found.turned_off == () and "llama.cpp issue 20824" in found.as_dict()["amx_risk"]
    assert not llama_cpu(FIX / "dgpu-x86", None, says(X86_AMX)).amx_risk  # no `hypervisor` flag


def test_an_arm_build_keeps_repacking_and_turns_nothing_off() -> None:
    found = llama_cpu(FIX / "orin-agx", None, says(ARM_CUDA))
    assert found.turned_off == () and found.cpu["REPACK"] == "1"
    assert found.lines()[:2] == ["CUDA: ARCHS=870 USE_GRAPHS", "CPU: NEON ARM_FMA FP16_VA DOTPROD LLAMAFILE OPENMP REPACK"]


def test_the_record_describes_only_the_libraries_it_was_written_for(tmp_path: Path) -> None:
    wheel, pkg, prefix = fake_install(tmp_path, ["-DGGML_NATIVE=OFF"], {"libllama.so": b"a", "libggml-cpu.so": b"b"})
    path = record_build(wheel, prefix)
    data = json.loads(path.read_text())
    assert data["key"] == "0123456789abcdef" and data["cmake_args"] == ["-DGGML_NATIVE=OFF"]
    assert sorted(data["libraries"]) == ["libggml-cpu.so", "libllama.so"]
    assert read_build_record(prefix, pkg).current
    (pkg / "lib" / "libggml-cpu.so").write_bytes(b"another build")  # pip installed another wheel since
    stale = llama_cpu(SPR_VM, pkg, says(X86_NO_AMX), prefix)
    assert stale.build is not None and not stale.build.current
    assert "describes another build" in stale.lines()[-1]
    assert stale.turned_off[0][1].endswith("(its build flags are not recorded here)")
    (prefix / BUILD_RECORD).write_text("{not json")
    assert read_build_record(prefix, pkg) is None


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler to build a library that faults")
def test_a_library_that_dies_when_loaded_is_reported_not_fatal(tmp_path: Path) -> None:
    src = tmp_path / "bad.c"
    src.write_text("#include <signal.h>\n__attribute__((constructor)) static void probe(void) { raise(SIGILL); }\n"
                   "const char *llama_print_system_info(void) { return \"\"; }\n")
    lib = tmp_path / "lib" / "libllama.so"
    lib.parent.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    text, error = system_info(lib)
    assert text == "" and "dies when it is loaded, by SIGILL" in error and "scripts/build-llama-wheel" in error
    assert llama_cpu(SPR_VM, tmp_path).error == error  # the package folder holding it
    lib.write_bytes(b"not an ELF file")
    assert "cannot load" in system_info(lib)[1]


def test_edge_device_shows_the_paths_without_loading_llama_cpp() -> None:
    if libllama() is None:
        pytest.skip("llama-cpp-python is not installed")
    r = subprocess.run([*EDGE, "device", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    llama = json.loads(r.stdout)["llama_cpp"]
    assert llama["error"] is None and "CPU" in llama["backends"]
    r = subprocess.run([*EDGE, "device"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "\nllama.cpp     CPU: " in r.stdout, r.stdout
    probe = ("import sys, runpy; sys.argv = ['edge'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('edge.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('LOADED', 'llama_cpp' in sys.modules, any('libllama' in line for line in "
             "open('/proc/self/maps')), file=sys.stderr)\n")
    for args in (["device"], ["doctor"]):
        p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        assert "LOADED False False" in p.stderr, (args, p.stderr)


def test_a_switch_given_twice_is_its_last_value_as_cmake_takes_it(tmp_path: Path) -> None:
    """scripts/test-two-builds' second build appends -DGGML_AVX512=OFF (EDGE_LLAMA_CMAKE_ARGS)
    after build-llama-wheel's own =ON: CMake takes the last, and so does the record's reader
    (what `edge device` shows and tests/model/test_cpupaths.py compares with the library)."""
    assert effective_args(("-DGGML_AVX=ON", "-DGGML_AVX512=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF")) == \
        ("-DGGML_AVX=ON", "-DGGML_AVX512=OFF", "-DGGML_FMA=ON")
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512=OFF"]
    wheel, pkg, prefix = fake_install(tmp_path, args, {"libllama.so": b"llama"})
    record_build(wheel, prefix)
    record = read_build_record(prefix, pkg)
    assert record is not None and record.cmake_args == ("-DGGML_NATIVE=OFF", "-DGGML_AVX512=OFF")
