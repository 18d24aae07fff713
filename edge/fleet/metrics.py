"""The fleet's view of one device: what it is, what it serves, and how its starts, reloads and OTA
installs went, as Prometheus families (prometheus_client; registered by `Metrics.track_fleet`).

Identity is exposed as info metrics (value 1, the facts in labels), so a fleet query joins them
onto any other series: `edge_last_start_seconds{phase="ready"} * on(instance) group_left(module)
edge_device_info`. Every label set is bounded by what the device is and serves (one series per
device, per served model or engine, per phase name, per result); nothing a client sends becomes
a label. The history families are read from the state dir (edge.fleet.history), so they survive a
restart; the device is detected once, at the first scrape.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from edge.fleet.crashes import cause_of
from edge.fleet.giveup import GiveUp
from edge.fleet.history import AFTER_READY, START_RESULTS, Ledger, OtaView, read_json, read_ota, reload_result, timestamp
from edge.model.gpu import llama_lib_dir
from edge.timing import RELOAD_REPORT_NAME, REPORT_NAME

__all__ = ["DEVICE_LABELS", "FleetCollector", "build_labels", "device_labels", "ggml_gpu_devices",
           "offloaded_layers", "quant_name"]

# label of edge_device_info -> field of `edge device` (edge.device.identity.DeviceInfo.as_dict()). The one
# mapping: a field the device module does not have (yet) is an empty label, never an error.
DEVICE_LABELS = {"platform": "platform", "module": "jetson_model", "l4t": "l4t_release",
                 "jetpack": "jetpack", "soc": "soc", "sm": "sm", "gpu": "gpu_name",
                 "cuda_driver": "cuda_driver", "cuda": "cuda", "tensorrt": "tensorrt",
                 "onnxruntime": "onnxruntime", "cpu_arch": "cpu_arch"}
# counter family, what the history ledger counts (edge.fleet.history), every result (0 until one
# happens: a rate over a result that has not happened yet is 0, not absent)
COUNTERS = (("edge_starts", "start", START_RESULTS, "Starts of the service on this device by result "
             "(ok: READY; before READY: failed, an error; stopped, SIGTERM; crashed, a signal; timeout, "
             "systemd's TimeoutStartSec=), across restarts."),
            ("edge_reloads", "reload", ("ok", "failed", "rolled_back"), "Reloads on this device by "
             "result (ok; failed: the old set kept serving; rolled_back: the previous config was "
             "loaded again), across restarts."),
            ("edge_handovers", "handover", ("ok", "restart", "failed"), "Reloads done by a new process "
             "taking over (edge reload --process, or a new edge, llama.cpp or unit environment installed) "
             "by result (ok: both ran, no gap; restart: memory did not allow both, the old one drained "
             "first; failed: the old process served on), across restarts."))
# the windows of edge_recent_starts and edge_recent_crashes (label, seconds): the alerts' own
STARTS_WINDOW, CRASHES_WINDOW = ("30m", 1800.0), ("1h", 3600.0)
GGML_DEVICE_TYPE_GPU = 1  # enum ggml_backend_dev_type: CPU, GPU, then (by version) IGPU or ACCEL


def _label(value: Any) -> str:
    return "" if value is None else str(value)


def device_labels(device: dict[str, Any]) -> dict[str, str]:
    return {label: _label(device.get(field)) for label, field in DEVICE_LABELS.items()}


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _soname_version(lib_dir: Path | None, stem: str) -> str:
    """"0.5.0" from lib/libllama.so.0.5.0: the version the library was built as."""
    if lib_dir is None:
        return ""
    versions = [p.name[len(stem) + 4:] for p in lib_dir.glob(f"{stem}.so.*.*")]
    return max(versions, key=len, default="")


def build_labels() -> dict[str, str]:
    from edge import __version__
    from edge.model.gpu import llama_build

    lib_dir = llama_lib_dir()
    return {"version": __version__, "python": platform.python_version(),
            "llama_cpp_python": _dist("llama-cpp-python"),
            "llama_cpp": _soname_version(lib_dir, "libllama"), "ggml": _soname_version(lib_dir, "libggml"),
            "backend": _label(llama_build())}


def quant_name(file_type: Any) -> str:
    """GGUF general.file_type as llama.cpp names it (Q4_K_M), from llama_cpp's LLAMA_FTYPE_* constants."""
    if not isinstance(file_type, int):
        return ""
    llama_cpp = sys.modules.get("llama_cpp")  # loaded wherever a model is served
    for name, value in vars(llama_cpp or object()).items():
        if name.startswith("LLAMA_FTYPE_") and value == file_type and name != "LLAMA_FTYPE_GUESSED":
            return name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    return f"ftype{file_type}"


def ggml_gpu_devices() -> int | None:
    """GPU devices the loaded ggml registered (a CUDA device by its name; any other of type GPU);
    None when llama_cpp is not loaded or its ggml cannot be asked. Asked of libggml itself,
    through its public device registry (the same library instance llama_cpp loaded)."""
    mod = sys.modules.get("llama_cpp")
    lib = next(iter(sorted((llama_lib_dir() or Path("/nonexistent")).glob("libggml.so*"))), None)
    if mod is None or lib is None:
        return None
    try:
        ggml = ctypes.CDLL(str(lib))
        ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        ggml.ggml_backend_dev_type.restype = ctypes.c_int
        ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
        ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
        devices = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
        return sum(1 for d in devices if ggml.ggml_backend_dev_type(d) == GGML_DEVICE_TYPE_GPU
                   or (ggml.ggml_backend_dev_name(d) or b"").startswith(b"CUDA"))
    except (OSError, AttributeError):
        return None


def offloaded_layers(requested: int, n_layer: int | None, gpu_devices: int | None) -> tuple[int, int] | None:
    """(requested, offloaded) layers as llama.cpp decides at load: n_gpu_layers < 0 means all,
    at most n_layer + 1 (the output layer counts as one), none without a GPU device."""
    if n_layer is None or (gpu_devices is None and requested != 0):
        return None
    want = n_layer + 1 if requested < 0 else min(requested, n_layer + 1)
    return want, (want if gpu_devices else 0)


def _gauge(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, v in rows:
        g.add_metric(values, v)
    return g


class FleetCollector:
    """Read at each scrape: `live()` is the serving set's ServiceState (or None); the state dir
    holds the reports and the OTA state. `device` and `gpu_devices` ask the hardware (tests pass
    doubles for them); each is asked once."""

    def __init__(self, state_dir: Path, live: Callable[[], Any], *,
                 device: Callable[[], dict[str, Any]] | None = None,
                 gpu_devices: Callable[[], int | None] = ggml_gpu_devices) -> None:
        self.state_dir = state_dir
        self.live = live
        self.ledger = Ledger(state_dir)
        self._device_fn = device or _detect_device
        self._gpu_devices_fn = gpu_devices
        self._identity: tuple[dict[str, str], dict[str, str]] | None = None
        self._gpus: tuple[int | None] | None = None

    def describe(self) -> list[Metric]:
        return []  # the families depend on the state dir; nothing to check for clashes up front

    def collect(self) -> Iterator[Metric]:
        if self._identity is None:
            self._identity = (build_labels(), device_labels(self._device_fn()))
        build, device = self._identity
        yield InfoMetricFamily("edge_build", "This edge: its version, Python, llama-cpp-python, the "
                               "llama.cpp and ggml it bundles, and their backend (cpu or cuda).", value=build)
        yield InfoMetricFamily("edge_device", "This device, as `edge device` shows it: platform, "
                               "Jetson module, L4T/JetPack, SoC, SM, GPU, CUDA (driver and runtime), "
                               "TensorRT, ONNX Runtime, CPU arch.", value=device)
        state = self.live()
        yield from self._models(getattr(state, "workers", None) or {})
        yield from self._engines(getattr(state, "engines", None) or {})
        yield from self._starts()
        yield from self._safe_mode(getattr(state, "safe_mode", None) or [])
        yield from _given_up(GiveUp.load(self.state_dir))
        yield from self._reloads()
        yield from _ota(read_ota(self.state_dir))

    def gpu_devices(self) -> int | None:
        if self._gpus is None:
            self._gpus = (self._gpu_devices_fn(),)
        return self._gpus[0]

    def _models(self, workers: dict[str, Any]) -> Iterator[Metric]:
        info = InfoMetricFamily("edge_model", "A served GGUF model: its sha256 (configured or "
                                "builtin; empty when none is configured), quantization, context "
                                "and GPU layers asked for.",
                                labels=["model"])
        locked, expected, ok, req, off = [], [], [], [], []
        for name, worker in workers.items():
            m = worker.model
            info.add_metric([name], {"sha256": _label(m.cfg.sha256).lower(),
                                     "quant": quant_name(m.info.metadata.get("general.file_type")),
                                     "n_ctx": str(m.n_ctx), "n_gpu_layers": str(m.cfg.n_gpu_layers)})
            locked.append(([name], float(m.mlock.locked_bytes)))
            expected.append(([name], float(m.mlock.expected_bytes)))
            ok.append(([name], float(m.mlock.ok)))
            n_layer = m.info.metadata.get(f"{m.info.architecture}.block_count")
            layers = offloaded_layers(int(m.cfg.n_gpu_layers), n_layer if isinstance(n_layer, int) else None,
                                      self.gpu_devices() if m.cfg.n_gpu_layers else 0)
            if layers is not None:
                req.append(([name], float(layers[0])))
                off.append(([name], float(layers[1])))
        yield info
        yield _gauge("edge_mlock_locked_bytes", "Bytes of the model that mlock locked (VmLck growth "
                     "over its load).", ["model"], locked)
        yield _gauge("edge_mlock_expected_bytes", "Bytes of the model that should be locked (what "
                     "stays resident on the CPU side).", ["model"], expected)
        yield _gauge("edge_mlock_ok", "1 when the lock took (or mlock is off by config), 0 when the "
                     "model stays pageable.", ["model"], ok)
        yield _gauge("edge_model_gpu_layers_requested", "Layers the config asks to offload to the "
                     "GPU (n_gpu_layers; -1 resolved to all, n_layer + 1).", ["model"], req)
        yield _gauge("edge_model_gpu_layers_offloaded", "Layers llama.cpp offloaded: the request, "
                     "or 0 when its ggml found no GPU device (the model runs on the CPU).", ["model"], off)

    def _engines(self, engines: dict[str, Any]) -> Iterator[Metric]:
        info = InfoMetricFamily("edge_engine", "A served engine: backend, key (the store's file "
                                "name: target, platform, versions, precision, profile) and sha256.",
                                labels=["engine"])
        for name, worker in engines.items():
            stored = worker.stored
            info.add_metric([name], {"backend": stored.key.backend, "key": stored.key.filename(),
                                     "sha256": stored.sha256, "precision": stored.key.precision})
        yield info

    def _starts(self) -> Iterator[Metric]:
        counts = self.ledger.update()
        for name, kind, results, doc in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["result"])
            for result in results:
                family.add_metric([result], float(counts.get(kind, {}).get(result, 0)))
            yield family
        crashes = CounterMetricFamily("edge_crashes", "Processes of the service that died by a signal "
                                      "(or found themselves unfit to go on: signal=\"none\"), by the phase "
                                      "they were in (\"serving\": after READY), the signal (\"unknown\": "
                                      "no exit record) and its cause (native-fault, fatal-error, unknown, oom, "
                                      "watchdog, timeout, outside-kill, exit: only the first three count "
                                      "towards safe mode), across restarts.", labels=["phase", "signal", "cause"])
        for key, n in sorted(counts.get("crash", {}).items()):
            phase, sig, cause = (key.split("/", 2) + [""])[:3]
            crashes.add_metric([phase, sig, cause or cause_of(sig)], float(n))  # counted before causes: by signal
        yield crashes
        yield from self._recent()
        report = read_json(self.state_dir / REPORT_NAME) or {}
        phases: dict[str, float] = {}
        for p in report.get("phases") or []:
            if isinstance(p, dict) and p.get("name") != "ready":
                phases[str(p.get("name"))] = phases.get(str(p.get("name")), 0.0) + float(p.get("seconds") or 0)
        if isinstance(report.get("ready_s"), (int, float)):
            phases["ready"] = float(report["ready_s"])
        yield _gauge("edge_last_start_seconds", "The last successful start: phase=\"ready\" is exec to "
                     "READY=1, every other phase its duration (summed over models and engines).",
                     ["phase"], [([k], v) for k, v in phases.items()])
        at = timestamp(report.get("started_at"))
        yield _gauge("edge_last_start_timestamp_seconds", "When the last successful start began "
                     "(unix time).", [], [([], at)] if at is not None else [])

    def _recent(self) -> Iterator[Metric]:
        """What the alerts need, counted here from the device's own history (each event by when it
        happened): no scrape gap, counter reset, recount or new Prometheus changes these."""
        starts = self.ledger.recent(STARTS_WINDOW[1]).get("start", {})
        yield _gauge("edge_recent_starts", "Starts on this device in the last `window` by result (as "
                     "edge_starts_total), by when they happened: EdgeStartsFailing counts failed, crashed "
                     "and timeout (stopped is an operator's).", ["result", "window"],
                     [([r, STARTS_WINDOW[0]], float(starts.get(r, 0))) for r in START_RESULTS])
        crashes: dict[str, int] = {}
        for key, n in self.ledger.recent(CRASHES_WINDOW[1]).get(AFTER_READY, {}).items():
            phase = key.partition("/")[0]
            crashes[phase] = crashes.get(phase, 0) + n
        yield _gauge("edge_recent_crashes", "Processes that died by a signal after READY (serving, or "
                     "in a reload) in the last `window`, by phase: EdgeCrashLoop.", ["phase", "window"],
                     [([p, CRASHES_WINDOW[0]], float(n)) for p, n in sorted({"serving": 0, **crashes}.items())])

    def _safe_mode(self, steps: list[dict[str, Any]]) -> Iterator[Metric]:
        yield _gauge("edge_safe_mode_info", "1 for each safe-mode step in force (edge safe-mode): the "
                     "phase whose crashes made it, and the fallback taken for which model or engine.",
                     ["phase", "target", "reason"],
                     [([str(s["phase"]), str(s["target"]), str(s["fallback"])], 1.0) for s in steps])

    def _reloads(self) -> Iterator[Metric]:
        report = read_json(self.state_dir / RELOAD_REPORT_NAME)
        rows: dict[str, list[tuple[list[str], float]]] = {"duration": [], "drain": [], "at": [], "result": []}
        if report is not None:
            failed = bool(report.get("error"))
            took = report.get("ready_s") if failed else report.get("switch_s")
            if isinstance(took, (int, float)):
                rows["duration"].append(([], float(took)))
            if isinstance(report.get("drain_s"), (int, float)):
                rows["drain"].append(([], float(report["drain_s"])))
            at = timestamp(report.get("started_at"))
            if at is not None:
                rows["at"].append(([], at))
            rows["result"].append(([reload_result(report)], 1.0))
        yield _gauge("edge_last_reload_duration_seconds", "The last reload: from its start to the "
                     "switch (or to its failure).", [], rows["duration"])
        yield _gauge("edge_last_reload_drain_seconds", "The last reload: how long the old set took "
                     "to drain after the switch.", [], rows["drain"])
        yield _gauge("edge_last_reload_timestamp_seconds", "When the last reload began (unix time).",
                     [], rows["at"])
        yield _gauge("edge_last_reload_result", "1 for the last reload's result (ok, failed, "
                     "rolled_back).", ["result"], rows["result"])


def _given_up(give_up: GiveUp | None) -> Iterator[Metric]:
    holds = give_up is not None and not give_up.retrying
    rows = [([give_up.phase, give_up.signal, give_up.target], 1.0)] if holds and give_up is not None else []
    yield _gauge("edge_given_up", "1 while safe mode is exhausted and the service only answers 503 (edge "
                 "safe-mode; docs/faults.md): the phase, signal and model or engine of the last "
                 "crash.", ["phase", "signal", "target"], rows)
    yield _gauge("edge_given_up_retry_timestamp_seconds", "While given up: when one start will try the "
                 "native path again (unix time).", [], [([], give_up.retry_at)] if holds and give_up else [])


def _ota(view: OtaView | None) -> Iterator[Metric]:
    info = InfoMetricFamily("edge_ota", "OTA versions (edge ota status): current, previous, pending "
                            "(an install not committed yet) and the highest ever committed.")
    last = GaugeMetricFamily("edge_ota_last_result", "1 for the last OTA install event: its version and "
                             "result (committed, rolled_back, rollback_unhealthy, staged; unknown when a "
                             "rebuilt state could not tell).",
                             labels=["version", "result"])
    at = GaugeMetricFamily("edge_ota_last_result_timestamp_seconds", "When the last OTA event happened "
                           "(unix time).")
    if view is not None:
        info.add_metric([], {"current": _label(view.current), "previous": _label(view.previous),
                             "pending": _label(view.pending), "highest": _label(view.highest)})
        if view.last_event:
            last.add_metric([_label(view.last_version), view.last_event.replace(" ", "_")], 1.0)
        if view.last_at is not None:
            at.add_metric([], view.last_at)
    yield info
    yield last
    yield at


def _detect_device() -> dict[str, Any]:
    from edge.device.identity import detect

    return detect().as_dict()
