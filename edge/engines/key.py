"""Engine keys: what an engine was built from and for. An engine runs only where its key fits.

One function, `key_for(entry, device)`, says what a config's `[[engines]]` entry needs of this
device; serving, `edge doctor`, `edge engines gc` and the OTA installer all use it. The build
side makes the key of what it built with `build_key` (same fields, coarsened where the build was
made hardware- or version-compatible). `EngineKey.differences(wanted)` is the one rule for
"does this stored engine run here": empty means yes.

A TensorRT key holds the SM arch, the platform (Jetson module from the device tree's
`compatible`, `jetson-p3767-0005`, never the carrier board's model string; or the dGPU product:
Orin AGX, NX and Nano are all sm_87 with different SM counts, an H100 and a GH200 both sm_90),
the board as a label only, the host platform
(`jetson`, or the CPU arch of a dGPU host: plans are not portable across them), the CUDA major,
the full TensorRT version of the module that deserializes (build number included), and the
build's hardware-compatibility level and version-compatible flag. The host platform is compared
for every engine; the platform too, except for a hardware-compatible engine, which runs on any
GPU of its level on the same host platform (and is never built on a Jetson, where TensorRT has
no hardware compatibility).

Keys before the module named the board (`jetson-agx-orin`, the slug of /proc/device-tree/model).
Such an engine is still accepted on a board of the same model string (what it was built for),
is refused elsewhere with a message saying what changed, and `edge engines rekey` gives it this
device's module key (`EngineKey.legacy_board`, `EngineKey.rekeyed`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.device.identity import DeviceInfo, slug
from edge.errors import EngineError, MissingDependency

if TYPE_CHECKING:
    from edge.config import EngineConfig
    from edge.engines.recipe import Recipe

__all__ = ["EngineKey", "BACKENDS", "build_key", "device_fields", "host_platform", "key_for", "profile_label"]

BACKENDS = ("tensorrt", "onnxruntime")
MODULE_PLATFORM = re.compile(r"jetson-p\d{4}-\d{4}")  # a Jetson key's platform since it names the module


@dataclass(frozen=True)
class EngineKey:
    model: str  # a label: engines are matched by model_sha256, so a config may name them freely
    model_sha256: str
    backend: str
    target: str  # sm_87 for TensorRT, cpu-x86_64 / cpu-aarch64 for ONNX Runtime
    precision: str
    profile: str = ""
    cuda: str | None = None  # CUDA major ("12"); None: not known, not compared
    tensorrt: str | None = None  # the full version of the module (build number where it has one)
    onnxruntime: str | None = None
    platform: str | None = None  # jetson-agx-orin / nvidia-h100-80gb-hbm3; None for hw-compatible
    hardware_compat: str = "none"
    version_compatible: bool = False
    host: str | None = None  # jetson | x86-64 | aarch64 (a dGPU host's CPU arch); None: older manifest
    board: str | None = None  # a Jetson's carrier board (slug of its model string): a label, not compared

    def filename(self) -> str:
        if self.backend == "tensorrt":
            parts = [self.target, self.platform or self.host, f"cuda{self.cuda}" if self.cuda else None,
                     f"trt{self.tensorrt}", "vc" if self.version_compatible else None,
                     None if self.hardware_compat == "none" else self.hardware_compat.replace("_", "-"),
                     self.precision, self.profile or None]
            return "-".join(p for p in parts if p) + ".engine"
        stem = f"{self.target}-ort{self.onnxruntime}-{self.precision}"
        return f"{stem}-{self.profile}.ort" if self.profile else f"{stem}.ort"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineKey":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def differences(self, wanted: "EngineKey") -> list[str]:
        """Why this (stored) engine cannot run where `wanted` was asked, as sentences; [] = it runs."""
        out = [_say(n, getattr(self, n), getattr(wanted, n)) for n in ("backend", "precision", "profile")
               if getattr(self, n) != getattr(wanted, n)]
        if self.backend == "onnxruntime":
            out += [_say(n, getattr(self, n), getattr(wanted, n)) for n in ("target", "onnxruntime")
                    if getattr(self, n) != getattr(wanted, n)]
            return out
        return out + self._gpu_differences(wanted) + self._software_differences(wanted)

    @property
    def legacy_board(self) -> str | None:
        """The board this Jetson engine's key names, if it is a key from before keys named the
        module (its platform is the slug of a board's model string); else None."""
        jetson = self.host == "jetson" or (self.host is None and str(self.platform).startswith("jetson-"))
        if self.backend != "tensorrt" or not jetson or not self.platform or MODULE_PLATFORM.fullmatch(self.platform):
            return None
        return self.platform

    def rekeyed(self, platform: str) -> "EngineKey":
        """This (legacy, board-keyed) key with a module's platform (`jetson-p3767-0005`), the
        board kept as its label."""
        return replace(self, platform=platform, board=self.legacy_board, host="jetson")

    def _platform_differences(self, wanted: "EngineKey") -> list[str]:
        if self.platform == wanted.platform:
            return []
        board = self.legacy_board
        if board is None:
            return [_say("platform", self.platform, wanted.platform)]
        if board == wanted.board:
            return []  # built on a board of this model, before keys named the module: same module then
        return [f"engine was built for board {board} (a key from before engine keys named the Jetson module "
                f"instead of the carrier board), this device is platform {wanted.platform} (board "
                f"{wanted.board or '(none)'}): rebuild it for this module, or run `edge engines rekey` "
                f"on a {board} board to key it by its module"]

    def _gpu_differences(self, wanted: "EngineKey") -> list[str]:
        if self.hardware_compat == "none":
            out = [] if self.target == wanted.target else [_say("target", self.target, wanted.target)]
            return out + self._platform_differences(wanted)
        # hardware-compatible: any GPU of the level, on the same host platform only
        out = [] if self.host is not None and self.host == wanted.host else [_say("host", self.host, wanted.host)]
        if self.hardware_compat == "ampere_plus":
            if _sm_number(wanted.target) < 80:
                out.append(f"engine was built hardware-compatible for Ampere and newer (sm_80+), "
                           f"this device is {wanted.target}")
        elif self.target != wanted.target:
            out.append(_say("target", self.target, wanted.target))
        return out

    def _software_differences(self, wanted: "EngineKey") -> list[str]:
        out = []
        if self.cuda and wanted.cuda and self.cuda != wanted.cuda:
            out.append(_say("cuda", self.cuda, wanted.cuda))
        have, want = self.tensorrt or "", wanted.tensorrt or ""
        if self.version_compatible:
            # a version-compatible engine runs on the same major at this or a later version
            if have.split(".")[0] != want.split(".")[0] or _numbers(want) < _numbers(have):
                out.append(f"engine was built version-compatible with tensorrt {have} (runs on "
                           f"{have.split('.')[0]}.x from {have} on), this device is tensorrt {want or '(none)'}")
        elif have != want:
            out.append(_say("tensorrt", have, want))
        return out


def _say(name: str, have: Any, want: Any) -> str:
    what = {"target": "", "platform": "platform ", "host": "host platform "}.get(name, f"{name} ")
    verb = "needs" if name in ("precision", "profile") else "is"
    return f"engine was built for {what}{have or '(none)'}, this device {verb} {what}{want or '(none)'}"


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def _sm_number(target: str | None) -> int:
    try:
        return int(str(target).removeprefix("sm_"))
    except ValueError:
        return 0


def device_fields(backend: str, device: DeviceInfo) -> dict[str, Any]:
    """The key fields this device asks of an engine for `backend`; an error says what is missing."""
    if backend == "tensorrt":
        if not device.sm and device.gpu_error:  # the driver said why: that is the one line to show
            raise EngineError(f"TensorRT engines need this device's GPU, and none could be used: {device.gpu_error}")
        missing = [n for n, v in (("GPU SM arch", device.sm), ("TensorRT version", device.tensorrt)) if not v]
        if missing:
            raise EngineError(f"TensorRT engines need {', '.join(missing)} of this device, and "
                              "none could be found (edge device shows what was detected)")
        return {"backend": backend, "target": device.sm, "platform": device.platform, "host": host_platform(device),
                "cuda": device.cuda.split(".")[0] if device.cuda else None, "tensorrt": device.tensorrt,
                "board": device.board}
    if backend == "onnxruntime":
        if not device.onnxruntime:
            raise MissingDependency("onnxruntime", "ort", "serving ONNX Runtime engines")
        return {"backend": backend, "target": f"cpu-{device.cpu_arch}", "onnxruntime": device.onnxruntime}
    raise EngineError(f"unknown engine backend {backend!r}: expected one of {list(BACKENDS)}")


def host_platform(device: DeviceInfo) -> str:
    """TensorRT's notion of a platform (plans are not portable across them): a Jetson, or the CPU
    arch of a host with a discrete GPU (an IGX board's dGPU included)."""
    return "jetson" if device.jetson_gpu else slug(device.cpu_arch)


def profile_label(recipe: "Recipe") -> str:
    names = [p.name for p in recipe.profiles]
    return "" if names == ["default"] else "+".join(names)


def key_for(entry: "EngineConfig", device: DeviceInfo) -> EngineKey:
    """The key this device needs for a config's engine entry: from its recipe (ONNX sha256,
    precision, profiles) or, on devices that hold no ONNX, from onnx_sha256/precision/profile."""
    if entry.recipe:
        from edge.engines.recipe import load_recipe
        from edge.fsutil import sha256_file

        recipe = load_recipe(entry.recipe)
        precision = recipe.precision if entry.backend == "tensorrt" else "fp32"
        return EngineKey(model=recipe.name, model_sha256=sha256_file(Path(recipe.onnx)), precision=precision,
                         profile=profile_label(recipe), **device_fields(entry.backend, device))
    if not entry.onnx_sha256:
        raise EngineError(f"engine {entry.name!r}: the config needs recipe, or onnx_sha256 and precision")
    precision = (entry.precision or "fp16") if entry.backend == "tensorrt" else "fp32"
    return EngineKey(model=entry.name, model_sha256=str(entry.onnx_sha256).lower(), precision=str(precision),
                     profile=entry.profile, **device_fields(entry.backend, device))


def build_key(recipe: "Recipe", backend: str, device: DeviceInfo, onnx_sha256: str) -> EngineKey:
    """The key of an engine built here from `recipe`: the device's fields, coarsened to what the
    build's compatibility settings make it run on."""
    key = EngineKey(model=recipe.name, model_sha256=onnx_sha256,
                    precision=recipe.precision if backend == "tensorrt" else "fp32",
                    profile=profile_label(recipe), **device_fields(backend, device))
    if backend != "tensorrt":
        return key
    if recipe.hardware_compatibility != "none":
        if device.jetson:
            raise EngineError(f"{recipe.source or recipe.name}: hardware_compatibility = "
                              f"\"{recipe.hardware_compatibility}\" cannot be built on a Jetson: TensorRT's "
                              "hardware compatibility is for discrete GPUs only, and a plan is not portable "
                              "between a Jetson and a dGPU host; set hardware_compatibility = \"none\"")
        key = replace(key, platform=None, hardware_compat=recipe.hardware_compatibility,
                      target="sm_80" if recipe.hardware_compatibility == "ampere_plus" else key.target)
    if recipe.version_compatible and not recipe.exclude_lean_runtime:
        # without its lean runtime a plan runs only on the lean runtime of the TensorRT that built
        # it (IRuntime.load_runtime): keyed to that exact version, not to the later ones
        key = replace(key, version_compatible=True)
    return key
