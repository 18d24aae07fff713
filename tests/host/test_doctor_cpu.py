"""`edge doctor`'s llama.cpp CPU lines: the paths, what edge turned off and why, and each model
whose extra buffer types are off (use_extra_bufts = false)."""

from __future__ import annotations

from pathlib import Path

from edge.config import load_config
from edge.host.doctor import run_checks
from edge.host.doctor_cpu import cpu_checks
from edge.model.cpupaths import AMX_RISK, LlamaCpu, libllama, parse_system_info
from kit import write_config

X86_AMX = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | "
ARM_NO_REPACK = "CPU : NEON = 1 | ARM_FMA = 1 | "


def two_models(tmp_path: Path, tiny_gguf: Path) -> Path:
    other = f'\n[[models]]\nname = "plain"\npath = "{tiny_gguf}"\nn_ctx = 256\n'
    return write_config(tmp_path / "edge.toml", tiny_gguf, extra_model="use_extra_bufts = false\n" + other)


def test_doctor_names_each_model_without_extra_buffer_types(tmp_path: Path, tiny_gguf: Path) -> None:
    checks = [c for c in run_checks(str(two_models(tmp_path, tiny_gguf)), [tmp_path / "no-units"])
              if c.name == "llama.cpp cpu"]
    if libllama() is None:
        assert checks[0].level == "fail" and "not installed" in checks[0].message
        return
    assert checks[0].level == "ok" and checks[0].message.startswith("CPU: "), checks[0]
    per_model = [c.message for c in checks[1:]]
    assert len(per_model) == 1 and per_model[0].startswith("model tiny: extra buffer types off "
                                                           "(use_extra_bufts = false"), per_model


def test_an_amx_build_on_a_vm_warns_for_the_models_that_would_use_it(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = load_config(two_models(tmp_path, tiny_gguf))
    risky = LlamaCpu(parse_system_info(X86_AMX), amx_risk=True)  # what the library and /proc/cpuinfo said
    rows = cpu_checks(cfg, risky)
    warn = [r for r in rows if r[1] == "warn"]
    assert len(warn) == 1 and warn[0][2] == f"{AMX_RISK}; models with extra buffer types on: plain"
    assert "use_extra_bufts = false" in warn[0][3] and "EDGE_LLAMA_AMX=1" in warn[0][3]
    arm = cpu_checks(cfg, LlamaCpu(parse_system_info(ARM_NO_REPACK)))
    assert [r[1] for r in arm] == ["ok", "ok"] and arm[1][2].endswith("(this build has no REPACK path anyway)")
    dead = cpu_checks(cfg, LlamaCpu(error="llama.cpp's library x dies when it is loaded, by SIGILL"))
    assert dead == [("llama.cpp cpu", "fail", "llama.cpp's library x dies when it is loaded, by SIGILL",
                     "rebuild llama-cpp-python for this CPU: scripts/setup")]
