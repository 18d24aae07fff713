"""`edge doctor`'s LoRA adapter check (issue 55): each model's `[[models.adapters]]` file read and
checked against the model's GGUF header as the load will (edge.model.adapters.check_adapter_file:
complete, a LoRA adapter, the model's architecture, tensors the model has), without llama.cpp.
The shapes llama.cpp checks at the load are not read here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge.config import BUILTIN_PREFIX
from edge.errors import EdgeError
from edge.model.adapters import check_adapter_file
from edge.model.mlock import mib

if TYPE_CHECKING:
    from edge.config import AdapterConfig, Config
    from edge.model.gguf import GGUFInfo

__all__ = ["adapter_checks"]

# (name, level ok|warn|fail, message, fix): edge.host.doctor makes its Check of each
Check = tuple[str, str, str, str]


def adapter_checks(cfg: Config) -> list[Check]:
    from edge.model.gguf import read_gguf_info

    out = []
    for i, m in enumerate(cfg.models):
        if not m.adapters:
            continue
        try:
            base: GGUFInfo | None = None if m.path.startswith(BUILTIN_PREFIX) else read_gguf_info(m.path)
        except EdgeError:
            continue  # the model's own check says why
        for j, a in enumerate(m.adapters):
            out.append(_one(f"adapter {m.name}:{a.name}", a, base, f"models[{i}].adapters[{j}]"))
    return out


def _one(name: str, a: AdapterConfig, base: GGUFInfo | None, where: str) -> Check:
    from edge.model.gguf import read_gguf_info

    path = a.path
    try:
        info = check_adapter_file(a, base, where) if base is not None else read_gguf_info(path)
    except EdgeError as exc:
        return (name, "fail", str(exc), f"point {where}.path at the GGUF LoRA adapter made for this model "
                "(llama.cpp's convert_lora_to_gguf.py), or remove the table; the start would exit 65")
    scale = a.scale
    alpha = info.metadata.get("adapter.lora.alpha")
    return (name, "ok", f"{path}: {mib(info.size)}, {len(info.tensors)} tensors, alpha {alpha}, "
                        f"default scale {scale}" + ("" if base is not None else " (checked against the model at its first start)"), "")
