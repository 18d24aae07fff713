"""Engine build recipes (engines/<model>.toml): the ONNX source, precision, profiles, workspace.

```toml
name = "mlp-demo"
onnx = "mlp-demo.onnx"          # relative to the recipe
precision = "fp16"              # fp32 | fp16 | int8
workspace_mb = 256
timing_cache = true              # per GPU + TensorRT version, beside the store
hardware_compatibility = "none"  # none | ampere_plus | same_compute_capability (TensorRT)
version_compatible = false       # runs on later TensorRT 10.x, and on the lean runtime

[[profiles]]
name = "default"
[[profiles.inputs]]
name = "x"
min = [1, 16]
opt = [4, 16]
max = [32, 16]
```
"""

from __future__ import annotations

import dataclasses
from edge import toml as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config import build_dataclass
from edge.errors import ConfigError

__all__ = ["HW_COMPAT", "InputRange", "Profile", "Recipe", "load_recipe", "check_onnx"]

PRECISIONS = ("fp32", "fp16", "int8")
# TensorRT's HardwareCompatibilityLevel, as recipes and keys spell it
HW_COMPAT = ("none", "ampere_plus", "same_compute_capability")


@dataclass(frozen=True)
class InputRange:
    name: str
    min: list[int]
    opt: list[int]
    max: list[int]


@dataclass(frozen=True)
class Profile:
    name: str = "default"
    inputs: list[InputRange] = field(default_factory=list)


@dataclass(frozen=True)
class Recipe:
    name: str
    onnx: str
    precision: str = "fp16"
    workspace_mb: int = field(default=256, metadata={"range": (1, 1 << 20)})
    timing_cache: bool = True
    hardware_compatibility: str = "none"
    version_compatible: bool = False
    exclude_lean_runtime: bool = False  # with version_compatible: the plan does not embed it
    profiles: list[Profile] = field(default_factory=lambda: [Profile()])
    source: str = ""

    @property
    def onnx_path(self) -> Path:
        return Path(self.onnx)


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    src = str(p)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(src, "", "recipe file does not exist") from None
    except IsADirectoryError:
        raise ConfigError(src, "", "is a directory; expected a recipe file (engines/<model>.toml)") from None
    except OSError as exc:
        raise ConfigError(src, "", f"cannot read the recipe file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(src, "", f"expected a UTF-8 TOML recipe, found a byte {exc.object[exc.start]:#04x} "
                                   f"that is not UTF-8 at offset {exc.start}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(src, "", f"not valid TOML: {exc}") from None
    r = build_dataclass(Recipe, raw, src, "")
    base = p.parent
    onnx = str((base / r.onnx).resolve())
    r = dataclasses.replace(r, onnx=onnx, source=src)
    _check_fields(r)
    return r


def _check_fields(r: Recipe) -> None:
    if r.precision not in PRECISIONS:
        raise ConfigError(r.source, "precision", f"expected one of {list(PRECISIONS)}, found {r.precision!r}")
    if r.hardware_compatibility not in HW_COMPAT:
        raise ConfigError(r.source, "hardware_compatibility",
                          f"expected one of {list(HW_COMPAT)}, found {r.hardware_compatibility!r}")
    if r.exclude_lean_runtime and not r.version_compatible:
        raise ConfigError(r.source, "exclude_lean_runtime", "only means something with version_compatible = true")
    if not Path(r.onnx).is_file():
        raise ConfigError(r.source, "onnx", f"ONNX file {r.onnx} does not exist")
    if not r.profiles:
        raise ConfigError(r.source, "profiles", "expected at least one [[profiles]] table")
    names = [p.name for p in r.profiles]
    if len(set(names)) != len(names):
        raise ConfigError(r.source, "profiles", f"profile names must be unique, found {names}")
    for i, prof in enumerate(r.profiles):
        for j, inp in enumerate(prof.inputs):
            where = f"profiles[{i}].inputs[{j}]"
            if not (len(inp.min) == len(inp.opt) == len(inp.max)) or not inp.min:
                raise ConfigError(r.source, where, f"min/opt/max must have the same, non-zero rank; "
                                  f"found {inp.min}, {inp.opt}, {inp.max}")
            for k, (a, b, c) in enumerate(zip(inp.min, inp.opt, inp.max)):
                if not 1 <= a <= b <= c:
                    raise ConfigError(r.source, f"{where}.min/opt/max[{k}]",
                                      f"expected 1 <= min <= opt <= max, found {a}, {b}, {c}")


def _dims(value_info: Any) -> list[int | str]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]


def check_onnx(r: Recipe) -> dict[str, Any]:
    """onnx.checker on the model, and every profile checked against its inputs. Returns a
    summary of inputs and outputs (name, element type, dims) to show before a build."""
    import onnx

    try:
        model = onnx.load(r.onnx)
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises DecodeError / ValidationError / ... : all "bad ONNX"
        raise ConfigError(r.source, "onnx", f"{r.onnx} is not a valid ONNX model: {exc}") from None
    inits = {i.name for i in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    etype = onnx.helper.tensor_dtype_to_np_dtype
    summary = {
        "inputs": [{"name": n, "dtype": str(etype(v.type.tensor_type.elem_type)), "dims": _dims(v)}
                   for n, v in inputs.items()],
        "outputs": [{"name": o.name, "dtype": str(etype(o.type.tensor_type.elem_type)), "dims": _dims(o)}
                    for o in model.graph.output],
        "opset": max((o.version for o in model.opset_import), default=0),
    }
    for i, prof in enumerate(r.profiles):
        given = {inp.name: inp for inp in prof.inputs}
        for name in set(given) - set(inputs):
            raise ConfigError(r.source, f"profiles[{i}].inputs", f"input {name!r} is not an input "
                              f"of {r.onnx}; its inputs are {sorted(inputs)}")
        for name, v in inputs.items():
            dims = _dims(v)
            dynamic = any(not isinstance(d, int) or d <= 0 for d in dims)
            if name not in given:
                if dynamic:
                    raise ConfigError(r.source, f"profiles[{i}].inputs", f"input {name!r} has dynamic "
                                      f"dims {dims}: the profile needs min/opt/max for it")
                continue
            rng = given[name]
            if len(rng.min) != len(dims):
                raise ConfigError(r.source, f"profiles[{i}].inputs.{name}",
                                  f"rank {len(rng.min)} does not match the model's {dims}")
            for k, d in enumerate(dims):
                if isinstance(d, int) and d > 0 and not (rng.min[k] == rng.opt[k] == rng.max[k] == d):
                    raise ConfigError(r.source, f"profiles[{i}].inputs.{name}",
                                      f"dim {k} is fixed at {d} in the model, profile gives "
                                      f"{rng.min[k]}/{rng.opt[k]}/{rng.max[k]}")
    return summary


def profile_shapes(r: Recipe, summary: dict[str, Any]) -> list[dict[str, tuple[list[int], list[int], list[int]]]]:
    """Per profile: input name -> (min, opt, max), static inputs filled in from the model."""
    out = []
    for prof in r.profiles:
        given = {inp.name: (inp.min, inp.opt, inp.max) for inp in prof.inputs}
        shapes = {}
        for inp in summary["inputs"]:
            if inp["name"] in given:
                shapes[inp["name"]] = given[inp["name"]]
            else:
                dims = [int(d) for d in inp["dims"]]
                shapes[inp["name"]] = (dims, dims, dims)
        out.append(shapes)
    return out
