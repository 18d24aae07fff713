"""`edge doctor`'s llama.cpp CPU check: the paths the library uses, the ones edge turned off and
why (edge.model.cpupaths), and per model whether its extra buffer types are off
(`use_extra_bufts = false`, llama.cpp's --no-repack)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge.model.cpupaths import AMX_RISK, LlamaCpu

if TYPE_CHECKING:
    from edge.config import Config

__all__ = ["cpu_checks"]

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]
NAME = "llama.cpp cpu"
NO_REPACK = ("extra buffer types off (use_extra_bufts = false in its [[models]] table, llama.cpp's "
             "--no-repack): its weights are not repacked for this CPU and AMX tiles are not used")


def _model_checks(cfg: Config, cpu: LlamaCpu) -> list[Check]:
    out = []
    for m in cfg.models:
        if not m.use_extra_bufts:
            anyway = "" if "REPACK" in cpu.cpu else " (this build has no REPACK path anyway)"
            out.append((NAME, "ok", f"model {m.name}: {NO_REPACK}{anyway}", ""))
    risky = [m.name for m in cfg.models if m.use_extra_bufts]
    if cpu.amx_risk and risky:
        out.append((NAME, "warn", f"{AMX_RISK}; models with extra buffer types on: {', '.join(risky)}",
                    "set use_extra_bufts = false in their [[models]] tables, or install a build without "
                    "AMX: scripts/setup (scripts/build-llama-wheel leaves it out unless EDGE_LLAMA_AMX=1)"))
    return out


def cpu_checks(cfg: Config, cpu: LlamaCpu) -> list[Check]:
    """Nothing when the config serves no model (engines do not use llama.cpp)."""
    if not cfg.models:
        return []
    if cpu.error:
        fix = ("pip install llama-cpp-python (scripts/setup builds it for this CPU)"
               if "not installed" in cpu.error else "rebuild llama-cpp-python for this CPU: scripts/setup")
        return [(NAME, "fail", cpu.error, fix)]
    return [(NAME, "ok", "; ".join(cpu.lines()), ""), *_model_checks(cfg, cpu)]
