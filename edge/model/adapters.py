"""LoRA adapters of a loaded model (issue 55): `[[models.adapters]]` checked against the model,
loaded on its weights through llama.cpp's adapter API, chosen per request.

llama.cpp applies adapters per context (llama_set_adapters_lora): every sequence of one
llama_decode runs with the same set. So a request's choice is a `Selection` (adapters and scales,
in name order, zero scales left out: a scale of 0 is the base model's output, and shares its
batches), and the scheduler (edge.model.slots) decodes one selection per step, taking the
selections that have work in turns.

An adapter's file is checked twice before it serves: edge's own reading of its GGUF header
(truncation, general.type "adapter", adapter.type "lora", the model's architecture, tensors the
model has), then llama.cpp's (every shape against the model's). Either refusal is a ModelError
(exit 65) naming the file and the config field.

The handles live as long as the model, in its `AdapterPool` keyed by file identity: a reload
that keeps the model and changes adapters loads only what is new, switches the served set at
the switch, and frees what no set uses once the old set has drained (`prune`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.config import AdapterConfig
from edge.errors import ModelError, RequestError
from edge.fsutil import file_identity
from edge.model.gguf import GGUFInfo, read_gguf_info

if TYPE_CHECKING:
    from edge.model.native import Native

__all__ = ["Adapter", "AdapterPool", "Selection", "check_adapter_file", "describe", "select", "selection_key"]


@dataclass(eq=False)
class Adapter:
    """One loaded adapter file (the handle llama.cpp gave) under its configured name and scale."""

    name: str
    path: str
    scale: float  # the default scale of a request that names none
    nbytes: int  # the file's size: what its tensors take beside the model
    ident: tuple[Any, ...]  # the file's identity when it was loaded
    alpha: float
    handle: Any = field(repr=False, default=None)  # llama_adapter_lora *

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "scale": self.scale, "bytes": self.nbytes, "alpha": self.alpha}


Selection = tuple[tuple[Adapter, float], ...]  # a request's adapters with their scales, by name


def selection_key(sel: Selection) -> tuple[tuple[str, float], ...]:
    """What makes two selections the same set in llama.cpp's context (names and scales)."""
    return tuple((a.name, s) for a, s in sel)


def describe(adapters: dict[str, Adapter]) -> list[dict[str, Any]]:
    return [a.describe() for a in adapters.values()]


def check_adapter_file(a: AdapterConfig, base: GGUFInfo, where: str) -> GGUFInfo:
    """edge's reading of an adapter's GGUF against the model's: ModelError naming what is wrong."""
    try:
        info = read_gguf_info(a.path)
    except ModelError as exc:
        raise ModelError(a.path, f"the LoRA adapter {exc.message} ({where}.path)") from None
    meta = info.metadata
    wrong = [(k, want, meta.get(k)) for k, want in (("general.type", "adapter"), ("adapter.type", "lora"),
                                                     ("general.architecture", base.architecture))
             if meta.get(k) != want]
    if wrong:
        k, want, got = wrong[0]
        raise ModelError(a.path, f"not a LoRA adapter for this model ({where}.path): {k} is {got!r}, "
                                 f"expected {want!r}")
    names = {t.name for t in base.tensors}
    targets = [t.name for t in info.tensors]
    stray = [n for n in targets if not n.endswith((".lora_a", ".lora_b")) or n.rsplit(".", 1)[0] not in names]
    if stray or not targets:
        raise ModelError(a.path, f"not a LoRA adapter for this model ({where}.path): "
                         + (f"tensor {stray[0]!r} adapts no tensor of {base.path}" if stray else "it has no tensors"))
    return info


class AdapterPool:
    """A model's loaded adapter handles by file identity (worker thread only)."""

    def __init__(self, native: Native) -> None:
        self.native = native
        self.handles: dict[tuple[Any, ...], Any] = {}

    def load(self, cfgs: list[AdapterConfig], base: GGUFInfo, where: str) -> dict[str, Adapter]:
        """The adapters of `cfgs`, each checked and loaded (or taken from the pool: same file)."""
        out = {}
        for j, a in enumerate(cfgs):
            key = f"{where}.adapters[{j}]"
            info = check_adapter_file(a, base, key)
            ident = (a.path, *file_identity(a.path))
            handle = self.handles.get(ident)
            if handle is None:
                handle = self.native.lib.llama_adapter_lora_init(self.native.model, a.path.encode())
                if not handle:
                    raise ModelError(a.path, f"llama.cpp refused the LoRA adapter ({key}.path): its tensors' "
                                     "shapes do not match the model's (made for another model?) or its data "
                                     "is damaged; llama.cpp's reason is in the log")
                self.handles[ident] = handle
            alpha = float(info.metadata.get("adapter.lora.alpha", 0.0))
            out[a.name] = Adapter(a.name, a.path, a.scale, info.size, ident, alpha, handle)
        return out

    def prune(self, used: list[dict[str, Adapter]]) -> int:
        """Free the handles no set in `used` holds (after the sets that held them drained); the
        context's own set cleared first, so llama.cpp never keeps a freed one. How many."""
        keep = {a.ident for adapters in used for a in adapters.values()}
        gone = [k for k in self.handles if k not in keep]
        if gone:
            self.native.use_adapters(())
        for k in gone:
            self.native.lib.llama_adapter_lora_free(self.handles.pop(k))
        return len(gone)


def select(model: str, adapters: dict[str, Adapter], suffix: str | None, lora: Any) -> Selection:
    """A request's selection: `model = "base:name"` (that adapter at its scale) and/or `lora`, a
    list of {"name" or "id", "scale"} as llama-server takes it (id: the index in /v1/models'
    adapters of the model). A 400 naming the unknown adapter or the bad field."""
    chosen: dict[str, float] = {}
    names = list(adapters)
    if suffix is not None:
        if suffix not in adapters:
            raise RequestError(f"model {model!r} has no adapter {suffix!r}; it has {names or 'none'}",
                               param="model", code="model_not_found")
        chosen[suffix] = adapters[suffix].scale
    if lora is not None:
        if not isinstance(lora, list):
            raise RequestError("lora: expected a list of {\"name\" or \"id\", \"scale\"}", param="lora")
        for i, item in enumerate(lora):
            name, scale = _lora_item(item, i, names, model)
            chosen[name] = adapters[name].scale if scale is None else scale
    return tuple((adapters[n], s) for n, s in sorted(chosen.items()) if s != 0.0)


def _lora_item(item: Any, i: int, names: list[str], model: str) -> tuple[str, float | None]:
    where = f"lora[{i}]"
    if not isinstance(item, dict) or ("name" in item) == ("id" in item):
        raise RequestError(f"{where}: expected an object with \"name\" or \"id\" (one of them) and "
                           "an optional \"scale\"", param=where)
    if "id" in item:
        ident = item["id"]
        if not isinstance(ident, int) or isinstance(ident, bool) or not 0 <= ident < len(names):
            raise RequestError(f"{where}.id: model {model!r} has no adapter {ident!r}; its ids are "
                               f"0 to {len(names) - 1} ({names})" if names else
                               f"{where}.id: model {model!r} has no adapters", param=f"{where}.id")
        name = names[ident]
    else:
        name = item["name"]
        if name not in names:
            raise RequestError(f"{where}.name: model {model!r} has no adapter {name!r}; it has {names or 'none'}",
                               param=f"{where}.name", code="model_not_found")
    scale = item.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not -100.0 <= scale <= 100.0):
        raise RequestError(f"{where}.scale: expected a number from -100 to 100, found {scale!r}",
                           param=f"{where}.scale")
    return name, None if scale is None else float(scale)

