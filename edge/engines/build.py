"""`edge build-engine`: build an engine offline (on the build host) and put it in the store.

TensorRT: Builder + ONNX parser + BuilderConfig with every recipe profile, the workspace limit,
precision, hardware/version compatibility, and a timing cache loaded before and saved after
(rebuilds skip tactic timing). The cache is kept per GPU and TensorRT version beside the store
(EngineStore.timing_cache); writing it is best effort after the engine is stored, and a cache
TensorRT rejects is reported, not silently dropped.
ONNX Runtime: the ONNX graph optimized offline and saved in ORT format, so the device only
loads it. Either way the result lands in the store atomically, keyed by the machine it was
built for.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.device.identity import DeviceInfo
from edge.engines.key import build_key
from edge.engines.recipe import Recipe, check_onnx, profile_shapes
from edge.engines.store import EngineStore, StoredEngine
from edge.errors import JETPACK_TRT, EngineError, require
from edge.fsutil import atomic_write, sha256_file

__all__ = ["build_engine"]

Progress = Callable[[str, int, int], None]  # (phase, step, total)


@dataclass
class BuildJob:
    """What a backend build gets: the recipe, its profile shapes, where to write, the timing
    cache to start from; what it leaves: flags used and the timing cache to save."""

    recipe: Recipe
    shapes: list[dict[str, Any]]
    out: Path
    progress: Progress
    log: Callable[[str], None]
    cache_in: bytes = b""
    flags: dict[str, Any] = field(default_factory=dict)
    cache_out: bytes | None = None


def build_engine(recipe: Recipe, backend: str, store: EngineStore, device: DeviceInfo,
                 progress: Progress | None = None, log: Callable[[str], None] = print) -> StoredEngine:
    summary = check_onnx(recipe)
    for io in ("inputs", "outputs"):
        for t in summary[io]:
            log(f"  {io[:-1]:6} {t['name']:<16} {t['dtype']:<8} {t['dims']}")
    key = build_key(recipe, backend, device, sha256_file(Path(recipe.onnx)))
    cache = store.timing_cache(key) if backend == "tensorrt" and recipe.timing_cache else None
    job = BuildJob(recipe, profile_shapes(recipe, summary), store.tmp_path(key), progress or (lambda *a: None),
                   log, cache_in=cache.read_bytes() if cache and cache.is_file() else b"")
    try:
        {"tensorrt": _build_tensorrt, "onnxruntime": _build_onnxruntime}[backend](job)
        build = {"recipe": recipe.source, "onnx": recipe.onnx, "io": summary, "flags": job.flags,
                 "profiles": [{n: {"min": s[0], "opt": s[1], "max": s[2]} for n, s in p.items()}
                              for p in job.shapes],
                 "profile_names": [p.name for p in recipe.profiles]}
        stored = store.put(key, job.out, build)
    finally:
        job.out.unlink(missing_ok=True)  # a failed or interrupted build leaves nothing visible
    if cache and job.cache_out:
        save_timing_cache(cache, job.cache_out, log)
    return stored


def save_timing_cache(path: Path, data: bytes, log: Callable[[str], None]) -> bool:
    """Best effort, after the engine is stored: a cache that cannot be written costs the next
    build its tactic timings, never this build its engine."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, mode=None)  # an engine: read by the service's own user (the umask's mode)
    except OSError as exc:
        log(f"  warning: timing cache not saved to {path}: {exc} (the engine is stored)")
        return False
    return True


def _build_onnxruntime(job: BuildJob) -> None:
    recipe, progress, log = job.recipe, job.progress, job.log
    ort = require("onnxruntime", "ort", "ONNX Runtime engine builds")
    if recipe.precision != "fp32":
        log(f"  onnxruntime: the CPU engine runs in fp32 (precision {recipe.precision} applies to TensorRT)")
    progress("optimize graph", 0, 1)
    so = ort.SessionOptions()
    # EXTENDED, not ALL: ALL adds layout rewrites tied to this CPU's vector width, and the key
    # only names the architecture.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(job.out)
    so.add_session_config_entry("session.save_model_format", "ORT")
    try:
        ort.InferenceSession(recipe.onnx, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
        raise EngineError(f"ONNX Runtime could not optimize {recipe.onnx}: {exc}") from None
    progress("optimize graph", 1, 1)
    job.flags = {"graph_optimization_level": "ORT_ENABLE_EXTENDED", "format": "ORT"}


def _import_trt_builder() -> Any:
    trt = require("tensorrt", "trt-dgpu", f"TensorRT engine builds (the full builder, not tensorrt-lean; {JETPACK_TRT})")
    if not hasattr(trt, "Builder"):
        raise EngineError("this TensorRT install has no builder (lean/dispatch runtime only): "
                          "build engines on a host with the full tensorrt package")
    return trt


# Recipe options -> (TensorRT enum.member, the first TensorRT version that has it)
_NEEDS = {
    "hardware_compatibility = \"ampere_plus\"": ("HardwareCompatibilityLevel.AMPERE_PLUS", "8.6"),
    "hardware_compatibility = \"same_compute_capability\"": ("HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY",
                                                             "10.9"),
    "version_compatible = true": ("BuilderFlag.VERSION_COMPATIBLE", "8.6"),
    "exclude_lean_runtime = true": ("BuilderFlag.EXCLUDE_LEAN_RUNTIME", "8.6"),
}


def check_support(trt: Any, recipe: Recipe) -> None:
    """Refuse, before any build, a recipe option the installed TensorRT lacks (JetPack 6 has 10.3:
    no SAME_COMPUTE_CAPABILITY), naming the version that has it."""
    asked = {"hardware_compatibility = \"ampere_plus\"": recipe.hardware_compatibility == "ampere_plus",
             "hardware_compatibility = \"same_compute_capability\"":
                 recipe.hardware_compatibility == "same_compute_capability",
             "version_compatible = true": recipe.version_compatible,
             "exclude_lean_runtime = true": recipe.exclude_lean_runtime}
    for option, wanted in asked.items():
        name, since = _NEEDS[option]
        enum, member = name.split(".")
        if wanted and not hasattr(getattr(trt, enum, None), member):
            raise EngineError(f"{recipe.source or recipe.name}: {option} needs TensorRT {since} or later "
                              f"({enum}.{member}); this is TensorRT {getattr(trt, '__version__', '?')}")


def _count_qdq(onnx_path: str) -> int:
    import onnx

    return sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in onnx.load(onnx_path).graph.node)


def _network(trt: Any, builder: Any, logger: Any, recipe: Recipe) -> tuple[Any, Any, bool]:
    # TensorRT 11 builds strongly typed networks only (no FP16/INT8 builder flags): precision
    # then comes from the ONNX's own types and Q/DQ nodes.
    strongly_typed = not hasattr(trt.BuilderFlag, "FP16")
    flags = 0
    if strongly_typed and hasattr(trt, "NetworkDefinitionCreationFlag") and \
            hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(recipe.onnx):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT's ONNX parser rejected {recipe.onnx}: {errors}")
    return network, parser, strongly_typed


def _compatibility(trt: Any, config: Any, recipe: Recipe, used: dict[str, Any]) -> None:
    """Hardware- and version-compatible builds: what the key's fields of the same name promise."""
    if recipe.hardware_compatibility != "none":
        level = {"ampere_plus": "AMPERE_PLUS", "same_compute_capability": "SAME_COMPUTE_CAPABILITY"}
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel,
                                                      level[recipe.hardware_compatibility])
        used["hardware_compatibility"] = recipe.hardware_compatibility
    if recipe.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        used["version_compatible"] = True
        if recipe.exclude_lean_runtime:
            config.set_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)
            used["exclude_lean_runtime"] = True


def _timing_cache(config: Any, job: BuildJob, used: dict[str, Any]) -> None:
    cache = config.create_timing_cache(job.cache_in)
    accepted = bool(config.set_timing_cache(cache, ignore_mismatch=False))
    used["timing_cache_in_bytes"] = len(job.cache_in)
    if job.cache_in and not accepted:
        # made by another GPU or TensorRT (or corrupt): tactics are timed afresh this time
        job.log(f"  warning: TensorRT rejected the timing cache ({len(job.cache_in)} bytes); "
                "building without it and saving a new one")
        used["timing_cache_rejected"] = True
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _build_tensorrt(job: BuildJob) -> None:
    recipe, trt = job.recipe, _import_trt_builder()
    check_support(trt, recipe)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser, strongly_typed = _network(trt, builder, logger, recipe)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, recipe.workspace_mb << 20)
    used: dict[str, Any] = {"workspace_mb": recipe.workspace_mb, "strongly_typed": strongly_typed,
                            "tensorrt": trt.__version__}
    _set_precision(trt, config, recipe, strongly_typed, used)
    _compatibility(trt, config, recipe, used)
    for prof in job.shapes:
        p = builder.create_optimization_profile()
        for name, (mn, opt, mx) in prof.items():
            p.set_shape(name, mn, opt, mx)
        config.add_optimization_profile(p)
    if recipe.timing_cache:
        _timing_cache(config, job, used)
    if hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = _monitor(trt, job.progress)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT failed to build {recipe.onnx} (its log above says why)")
    with open(job.out, "wb") as f:
        f.write(memoryview(plan))
        f.flush()
        os.fsync(f.fileno())
    if recipe.timing_cache:
        job.cache_out = bytes(memoryview(config.get_timing_cache().serialize()))
    job.flags = used


def _set_precision(trt: Any, config: Any, recipe: Recipe, strongly_typed: bool, used: dict[str, Any]) -> None:
    if recipe.precision == "fp32":
        return
    if recipe.precision == "int8" and _count_qdq(recipe.onnx) == 0:
        raise EngineError(f"precision int8 needs an explicitly quantized ONNX (QuantizeLinear/"
                          f"DequantizeLinear nodes); {recipe.onnx} has none")
    if strongly_typed:
        if recipe.precision == "fp16":
            import onnx

            types = {i.type.tensor_type.elem_type for i in onnx.load(recipe.onnx).graph.initializer}
            if onnx.TensorProto.FLOAT16 not in types:
                raise EngineError(f"TensorRT {trt.__version__} builds strongly typed networks: precision "
                                  f"fp16 needs an ONNX with fp16 weights, and {recipe.onnx} has none; "
                                  "export it in fp16 or set precision = \"fp32\"")
        used["precision_from"] = "onnx types"
        return
    flag = {"fp16": trt.BuilderFlag.FP16, "int8": trt.BuilderFlag.INT8}[recipe.precision]
    config.set_flag(flag)
    if recipe.precision == "int8":
        config.set_flag(trt.BuilderFlag.FP16)  # layers without Q/DQ fall back to fp16, not fp32
    used["builder_flags"] = [recipe.precision] + (["fp16"] if recipe.precision == "int8" else [])


def _monitor(trt: Any, progress: Progress) -> Any:
    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.totals: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.totals[phase_name] = num_steps
            progress(phase_name, 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            progress(phase_name, step + 1, self.totals.get(phase_name, step + 1))
            return True  # keep building

        def phase_finish(self, phase_name: str) -> None:
            total = self.totals.get(phase_name, 1)
            progress(phase_name, total, total)

    return Monitor()
