"""`edge doctor`'s model checks: each model's file (a builtin's assembled copy, else its GGUF
header), the context and slots a start will make and why (edge.model.memory.context_plan), its
KV cache by type at that context and the embeddings context beside it; a fail where llama.cpp
would refuse its KV types."""

from __future__ import annotations

from edge.config import BUILTIN_PREFIX, Config, ModelConfig, cache_dir
from edge.errors import EdgeError
from edge.model.gguf import GGUFInfo, read_gguf_info
from edge.model.mlock import mib

__all__ = ["model_checks"]

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]


def model_checks(cfg: Config) -> list[Check]:
    checks = []
    for m in cfg.models:
        if m.path.startswith(BUILTIN_PREFIX):
            target = cache_dir(cfg) / "models"
            found = sorted(target.glob("*.gguf")) if target.is_dir() else []
            info = None
            if found:
                try:
                    info = read_gguf_info(str(found[0]))
                except EdgeError:
                    info = None
            checks.append((f"model {m.name}", "ok",
                           f"{m.path}: " + ("assembled in " + str(target) if found else
                                            "assembled and verified on first start") + f"; {_slots(m, info)}"
                           + (f"; KV cache {m.type_k}/{m.type_v}" if (m.type_k, m.type_v) != ("f16", "f16") else ""),
                           ""))
            continue
        try:
            info = read_gguf_info(m.path)
        except EdgeError as exc:
            checks.append((f"model {m.name}", "fail", str(exc),
                           "point models.path at a complete GGUF file (re-copy it if truncated)"))
            continue
        checks.append(_model_check(m, info))
    return checks


def _model_check(m: ModelConfig, info: GGUFInfo) -> Check:
    """The file, the context and slots, and what its KV cache and embeddings context cost (issue
    55): a fail where llama.cpp would refuse its KV types."""
    from edge.host.doctor_memory import service_ceiling
    from edge.model.kvtypes import kv_type_problem, kv_types_label
    from edge.model.memory import context_plan, embeddings_need, kv_bytes

    head = f"{m.path}: GGUF v{info.version}, {info.architecture}, {mib(info.size)}, {info.tensor_count} tensors"
    problem = kv_type_problem(m, info)
    if problem is not None:
        return (f"model {m.name}", "fail", f"{head}; models.{problem[0]}: {problem[1]}",
                f"set {problem[0]} to f16 (or a type whose block divides the head size)")
    n_ctx = context_plan(m, info, service_ceiling()).n_ctx
    kv = f"KV cache {kv_types_label(m)}: {mib(kv_bytes(m, info, n_ctx))} at n_ctx = {n_ctx}"
    embed = f"; embeddings context: {mib(embeddings_need(m, info))}" if m.embeddings else ""
    return (f"model {m.name}", "ok", f"{head}; {_slots(m, info)}; {kv}{embed}", "")


def _slots(m: ModelConfig, info: GGUFInfo | None) -> str:
    """The context and slots a start will make (edge.model.memory.context_plan: set, or sized
    for the model and the memory edge.service may hold) and why: the slots share the context's
    cells (unified KV) and take them as tokens are decoded, so one request alone may use all."""
    from edge.host.doctor_memory import service_ceiling
    from edge.model.memory import context_plan

    if info is None and m.n_ctx is None:
        return (f"n_ctx: the model's trained context, sized to memory at the first start (the model is not "
                f"assembled yet); parallel: {m.parallel or 'automatic'}")
    p = context_plan(m, info, service_ceiling())
    return (f"n_ctx = {p.n_ctx} ({p.n_ctx_why}), {p.parallel} slots ({p.parallel_why}) sharing its cells, "
            f"taken as tokens are decoded")
