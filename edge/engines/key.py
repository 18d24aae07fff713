"""Engine keys: what an engine was built from and for. An engine runs only where its key matches."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from edge.device import DeviceInfo
from edge.errors import EngineError, MissingDependency

__all__ = ["EngineKey", "device_fields", "BACKENDS"]

BACKENDS = ("tensorrt", "onnxruntime")
# the fields that tie an engine to the machine it runs on, in the order a mismatch is reported
DEVICE_FIELDS = ("backend", "target", "cuda", "tensorrt", "onnxruntime")


@dataclass(frozen=True)
class EngineKey:
    model: str
    model_sha256: str
    backend: str
    target: str  # sm_87 for TensorRT, cpu-x86_64 / cpu-aarch64 for ONNX Runtime
    precision: str
    profile: str = ""
    cuda: str | None = None
    tensorrt: str | None = None
    onnxruntime: str | None = None

    def filename(self) -> str:
        if self.backend == "tensorrt":
            stem, ext = f"{self.target}-cuda{self.cuda}-trt{self.tensorrt}-{self.precision}", "engine"
        else:
            stem, ext = f"{self.target}-ort{self.onnxruntime}-{self.precision}", "ort"
        return f"{stem}-{self.profile}.{ext}" if self.profile else f"{stem}.{ext}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineKey":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def differences(self, wanted: "EngineKey") -> list[str]:
        """How this (stored) key differs from the wanted one, as sentences."""
        out = []
        for name in DEVICE_FIELDS + ("precision", "profile"):
            have, want = getattr(self, name), getattr(wanted, name)
            if have != want:
                what = {"target": "", "backend": "backend ", "precision": "precision ",
                        "profile": "profile "}.get(name, f"{name} ")
                out.append(f"engine was built for {what}{have or '(none)'}, "
                           f"this device {'needs' if name in ('precision', 'profile') else 'is'} "
                           f"{what}{want or '(none)'}")
        return out


def device_fields(backend: str, device: DeviceInfo) -> dict[str, Any]:
    """The key fields this device asks of an engine for `backend`; an error says what is missing."""
    if backend == "tensorrt":
        missing = [n for n, v in (("GPU SM arch", device.sm), ("CUDA version", device.cuda),
                                  ("TensorRT version", device.tensorrt)) if not v]
        if missing:
            raise EngineError(f"TensorRT engines need {', '.join(missing)} of this device, and "
                              "none could be found (edge device shows what was detected)")
        return {"backend": backend, "target": device.sm, "cuda": device.cuda, "tensorrt": device.tensorrt}
    if backend == "onnxruntime":
        if not device.onnxruntime:
            raise MissingDependency("onnxruntime", "ort", "serving ONNX Runtime engines")
        return {"backend": backend, "target": f"cpu-{device.cpu_arch}", "onnxruntime": device.onnxruntime}
    raise EngineError(f"unknown engine backend {backend!r}: expected one of {list(BACKENDS)}")
