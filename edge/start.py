"""The cold start: what `edge serve` does from exec to READY=1, in the order it happens.

Read `ColdStart.run()` top to bottom to learn what a start is (DESIGN.md, "The path of a
start"); every step is a timed phase of the start report, named once in `edge.timing.Phases`:

    config → sockets → resolve_models → page_in ‖ validate ‖ imports → model_load ‖ imports_http
    → mlock_verify → engines → warmup (floor, then the stored plan or a calibration) → http_setup
    → ready → serve (until SIGTERM, then drain)

The sockets are listening before anything slow happens, so a connection made at any point of
the start waits in the kernel's backlog and is accepted only once warm-up is done.

`load()` and `warm()` are the load-and-warm step on their own: they make a `Loaded` set (app,
workers, engines, what was loaded) from a config, without touching the sockets, so that
`edge warmup` (a rehearsal) and a reload reuse them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import gc
import importlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import Config, EngineConfig, ModelConfig, cache_dir, check_writable, find_config, load_config, state_dir
from edge.errors import StoppedDuringStart, require
from edge.mlock import enforce
from edge.systemd import Notifier, listen_sockets, setup_logging
from edge.timing import Phases, StartTimer, write_report

if TYPE_CHECKING:
    from edge.app import ServiceState
    from edge.gguf import GGUFInfo
    from edge.metrics import Metrics
    from edge.modelfile import ModelFile
    from edge.worker import ModelWorker

__all__ = ["ColdStart", "Loaded", "LoadPlan", "model_key"]

log = logging.getLogger("edge")


@dataclass
class Loaded:
    """One loaded and (after `ColdStart.warm`) warmed set: what serves, and what it is."""

    app: Any  # the Starlette app built over `state`
    state: ServiceState
    infos: list[dict[str, Any]]
    warmup: list[dict[str, Any]] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)  # per model/engine: plan, candidates
    keys: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # name -> what makes it the same
    kept: list[str] = field(default_factory=list)  # workers taken over from the previous set
    closed: set[str] = field(default_factory=set)

    @property
    def names(self) -> list[str]:
        return [*self.state.workers, *self.state.engines]

    def workers(self) -> dict[str, Any]:
        return {**self.state.workers, **self.state.engines}

    def close(self, keep: Loaded | None = None) -> list[str]:
        """Close every worker that `keep` (the set taking over) does not share; their names."""
        shared = {id(w) for w in keep.workers().values()} if keep else set()
        freed = []
        for name, worker in self.workers().items():
            if id(worker) not in shared and name not in self.closed:
                worker.close()  # waits for the job on its thread, if any
                llama = getattr(getattr(worker, "model", None), "llama", None)
                if hasattr(llama, "close"):
                    llama.close()  # the context and the mapping now, not whenever GC gets to it
                self.closed.add(name)
                freed.append(name)
        return freed

    def only(self, names: list[str]) -> Loaded:
        """This set cut down to `names` (what is left of it while a sequential reload loads)."""
        state = dataclasses.replace(
            self.state, workers={n: w for n, w in self.state.workers.items() if n in names},
            engines={n: e for n, e in self.state.engines.items() if n in names})
        return Loaded(None, state, [i for n, i in zip(self.names, self.infos) if n in names],
                      keys={n: k for n, k in self.keys.items() if n in names}, closed=self.closed)


@dataclass
class LoadPlan:
    """What a load will do: model files to load, engines to load, workers to take over."""

    files: list[ModelFile]
    engines: list[EngineConfig]
    keys: dict[str, tuple[Any, ...]]
    kept: dict[str, Any] = field(default_factory=dict)  # name -> worker of the previous set
    kept_infos: dict[str, dict[str, Any]] = field(default_factory=dict)


def model_key(m: ModelConfig) -> tuple[Any, ...]:
    """A model is the same one when its resolved file (same inode, size and mtime) and every
    setting that shapes the loaded model are; page-in settings do not."""
    try:
        st = os.stat(m.path)
        ident: tuple[int, ...] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        ident = ()
    return ("model", dataclasses.replace(m, prefetch=True, prefetch_threads=1), ident)


class ColdStart:
    """One start of the service: the config, the timer, the notifier, the sockets, what was loaded."""

    def __init__(self, config_path: str | None = None, *, cfg: Config | None = None,
                 timer: StartTimer | None = None, notifier: Notifier | None = None) -> None:
        self.timer = timer or StartTimer()  # offsets from exec, whenever it is made
        self.config_path = config_path
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.sockets: list[socket.socket] = []
        self.loaded: Loaded | None = None
        self._validations: list[concurrent.futures.Future[tuple[float, float, GGUFInfo]]] = []
        self.recalibrate = False  # `edge warmup --calibrate`: measure anew whatever is stored
        # Test hook: called with the loaded set just before the warm-up, so that a test can put a
        # double at the backend boundary (a wrapper around a model's llama object); None in service.
        self.before_warm: Callable[[Loaded], None] | None = None
        self.hup_pending = False  # SIGHUP before READY: reload once serving

    # -- the start, top to bottom ----------------------------------------------------------------
    def run(self) -> int:
        """Start, warm up, serve until SIGTERM/SIGINT, drain; the exit code."""
        self.read_config()
        self.open_sockets()
        signal.signal(signal.SIGTERM, _stop_during_start)
        signal.signal(signal.SIGHUP, self._hup_during_start)
        self.notifier.extend_while()
        try:
            self.loaded = self.load()
            return asyncio.run(self._warm_and_serve(self.loaded))
        except StoppedDuringStart:
            if self.loaded is not None:
                self.loaded.close()  # lets a cancelled warm-up generation end first
            log.info("stopped by SIGTERM before ready")
            return 0

    async def _warm_and_serve(self, loaded: Loaded) -> int:
        from edge.reload import Reloader
        from edge.serving import Dispatcher, build_server, serve_http

        stop = await self._warm_unless_stopped(loaded)
        with self.timer.phase(Phases.HTTP_SETUP):
            dispatcher = Dispatcher(loaded)  # a reload swaps the set behind it
            server = build_server(dispatcher, self.config.server, self.notifier)
            reloader = Reloader(self, dispatcher, lambda: server.handle_exit(signal.SIGTERM, None))
            gc.collect()
            gc.freeze()  # warm-up garbage is gone; what lives now is never scanned again
        if stop.is_set():
            raise StoppedDuringStart("SIGTERM before ready")
        ready_text = self.mark_ready(loaded)
        async with reloader:
            await serve_http(server, self.sockets, self.notifier, ready_text, stop)
        dispatcher.loaded.close()
        return reloader.fatal.exit_code if reloader.fatal else 0

    def _hup_during_start(self, sig: int, frame: Any) -> None:
        log.info("SIGHUP during the start: reloading once ready")
        self.hup_pending = True


    async def _warm_unless_stopped(self, loaded: Loaded) -> asyncio.Event:
        """The warm-up, given up at SIGTERM/SIGINT. From here on a signal only sets the returned
        event (the loop delivers it): raised inside whatever the loop runs, it would fail a
        warm-up request (exit 70) or break a lock (hang). uvicorn takes the signals over later."""
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        warming = asyncio.ensure_future(self.warm(loaded))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({warming, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            stopped.cancel()
            warming.result()  # the warm-up's own error, if any
            return stop
        warming.cancel()
        await asyncio.wait({warming})
        raise StoppedDuringStart("SIGTERM during warm-up")

    def rehearse(self, recalibrate: bool = False) -> dict[str, Any]:
        """Everything a start does up to READY, with no socket and no report written: what a
        start would take (`edge warmup`; with `recalibrate`, the warm-up plan is measured and
        stored anew)."""
        self.notifier.enabled = False
        self.recalibrate = recalibrate
        self.read_config()
        loaded = self.load()

        async def go() -> dict[str, Any]:
            if self.before_warm is not None:
                self.before_warm(loaded)
            await self.warm(loaded)
            return self.timer.report(config=self.config.source, sockets=[], models=loaded.infos,
                                     warmup=loaded.warmup, calibration=loaded.plans, rehearsal=True)

        try:
            return asyncio.run(go())
        finally:
            loaded.close()

    # -- the phases --------------------------------------------------------------------------------
    @property
    def config(self) -> Config:
        if self.cfg is None:
            raise RuntimeError("read_config() first")
        return self.cfg

    def read_config(self) -> Config:
        if self.cfg is None:
            with self.timer.phase(Phases.CONFIG):
                self.cfg = load_config(find_config(self.config_path))
                check_writable(self.cfg)  # before the load, not at READY
        setup_logging(self.cfg.server.log_level)
        return self.cfg

    def open_sockets(self) -> list[socket.socket]:
        """Inherited from systemd (LISTEN_FDS), else bound now from the [server] table."""
        from edge.serving import bind_sockets

        with self.timer.phase(Phases.SOCKETS) as ph:
            self.sockets = listen_sockets()
            ph.detail["inherited"] = bool(self.sockets)
            if not self.sockets:
                self.sockets = bind_sockets(self.config.server, self.config.source)
        return self.sockets

    def load(self, plan: LoadPlan | None = None, metrics: Metrics | None = None) -> Loaded:
        """Model files, backends, models and engines: the load half of load-and-warm. A reload
        passes the plan it made (`prepare(previous)`) and the metrics that carry over."""
        plan = plan or self.prepare()
        self.import_backends(plan)
        self.finish_model_files(plan.files)
        # llama.cpp loads with the GIL released: the HTTP stack is imported meanwhile.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-load") as pool:
            loading = pool.submit(self.load_models, plan.files)
            self.import_http()
            loaded_workers, infos = loading.result()
        from edge.app import ServiceState, build_app

        engines: dict[str, Any] = {}
        engine_infos: list[dict[str, Any]] = []
        if plan.engines:  # the engine modules (numpy, the store) are imported only for engines
            from edge.engines.load import load_engines

            engines, engine_infos = load_engines(dataclasses.replace(self.config, engines=plan.engines), self.timer)
        new = {**loaded_workers, **engines}
        pick = {**plan.kept, **new}
        by_name = {**dict(zip(loaded_workers, infos)), **dict(zip(engines, engine_infos))}
        by_name.update({n: {**i, "kept": True} for n, i in plan.kept_infos.items()})
        state = ServiceState(workers={m.name: pick[m.name] for m in self.config.models},
                             engines={e.name: pick[e.name] for e in self.config.engines})
        if metrics is not None:
            state.metrics = metrics
        return Loaded(build_app(state), state, [by_name[n] for n in [*state.workers, *state.engines]],
                      keys=plan.keys, kept=list(plan.kept))

    def prepare(self, previous: Loaded | None = None) -> LoadPlan:
        """Resolve every model file; take over what `previous` already has loaded the same way;
        start the page-in of the others and validate them from the warming pages: on a thread
        beside the backend imports at a start (`finish_model_files` joins it), at once for a
        reload (its memory guard reads every header)."""
        from edge.modelfile import ModelFile, VerifiedCache, resolve_model

        cfg = self.config
        verified = VerifiedCache(cache_dir(cfg) / "verified.json")
        with self.timer.phase(Phases.RESOLVE_MODELS):
            models = [resolve_model(m, cache_dir(cfg), verified) for m in cfg.models]
        plan = LoadPlan([], [], {})
        before = previous.keys if previous else {}
        old = previous.workers() if previous else {}
        for m in models:
            plan.keys[m.name] = model_key(m)
            if before.get(m.name) == plan.keys[m.name] and plan.keys[m.name][2]:
                plan.kept[m.name] = old[m.name]
                continue
            plan.files.append(ModelFile(m, verified).start())
        if previous is None:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-validate")
            self._validations = [pool.submit(self._validate, f) for f in plan.files]
            pool.shutdown(wait=False)  # the queued validations still run; joined by finish_model_files
        else:
            self._validations = [_done(self._validate(f)) for f in plan.files]
        for e in cfg.engines:
            plan.keys[e.name] = ("engine", e)
            if before.get(e.name) == plan.keys[e.name]:
                plan.kept[e.name] = old[e.name]
            else:
                plan.engines.append(e)
        if previous:
            plan.kept_infos = {n: i for n, i in zip(previous.names, previous.infos) if n in plan.kept}
        return plan

    def _validate(self, f: ModelFile) -> tuple[float, float, GGUFInfo]:
        start = self.timer.now()
        info = f.validate()
        return start, self.timer.now(), info

    def import_backends(self, plan: LoadPlan) -> None:
        """llama_cpp (and onnxruntime) imported beside the page-in threads."""
        with self.timer.phase(Phases.IMPORTS) as ph:
            self.notifier.status("importing the inference backends")
            ph.detail["modules"] = _import((["llama_cpp"] if plan.files else []) + (
                ["onnxruntime"] if any(e.backend == "onnxruntime" for e in plan.engines) else []))

    def finish_model_files(self, files: list[ModelFile]) -> None:
        """Join the validations and page-ins (their real start and end in the report); check the
        sha256. A file that fails validation raises here, before llama.cpp sees it."""
        for f, done in zip(files, self._validations):
            start, end, info = done.result()
            ph = self.timer.add(Phases.VALIDATE, start, end, nbytes=info.size, model=f.cfg.name)
            ph.detail.update(info.summary())
        mono0 = time.monotonic() - self.timer.now()
        for f in files:
            res = f.finish()
            if res is not None:
                self.timer.add(Phases.PAGE_IN, res.start_s - mono0, res.end_s - mono0, nbytes=res.bytes,
                               model=f.cfg.name, threads=f.pagein.threads if f.pagein else 0,
                               **res.as_detail())

    def import_http(self) -> None:
        with self.timer.phase(Phases.IMPORTS_HTTP) as ph:
            ph.detail["modules"] = _import(["uvicorn", "starlette.applications", "edge.app", "edge.serving"])

    def load_models(self, files: list[ModelFile]) -> tuple[dict[str, ModelWorker], list[dict[str, Any]]]:
        """Each model through llama.cpp (mmap, mlock), then the lock measured and the policy applied."""
        from edge.llm import load_gguf_model
        from edge.worker import ModelWorker

        workers, infos = {}, []
        for f in files:
            m = f.cfg
            self.notifier.status(f"loading {m.name} ({m.path})")
            with self.timer.phase(Phases.MODEL_LOAD, model=m.name, use_mmap=m.use_mmap,
                                  use_mlock=m.use_mlock) as ph:
                model = load_gguf_model(m, f.validate() if f.info is None else f.info)
                ph.bytes = model.info.size
            with self.timer.phase(Phases.MLOCK_VERIFY, model=m.name) as ph:
                ph.detail.update(model.mlock.as_dict())
                enforce(m, model.mlock)
            workers[m.name] = ModelWorker(model, self.config.server.max_queue)
            infos.append({"name": m.name, "path": m.path, "n_ctx": model.n_ctx,
                          "mlock": model.mlock.as_dict(), **model.info.summary()})
        return workers, infos

    async def warm(self, loaded: Loaded) -> list[dict[str, Any]]:
        """The warm half of load-and-warm: for each model and engine the floor request, then its
        stored plan (known key) or a calibration that makes one (new key), over loopback HTTP."""
        from edge.warmplan import PlanStore, warm_one
        from edge.warmup import LoopbackHTTP

        cfg = self.config
        store = PlanStore(cache_dir(cfg) / "warmup")
        with self.timer.phase(Phases.WARMUP_SETUP):  # what to warm; the loopback server started
            targets = await self._warm_targets(loaded)
            http = await LoopbackHTTP(loaded.app).__aenter__()
        async with http:
            for target in targets:
                self.notifier.status(f"warming up {target.name}")
                with self.timer.phase(Phases.WARMUP, **{target.kind: target.name}) as ph:
                    result = await warm_one(http, target, cfg.warmup, store, recalibrate=self.recalibrate,
                                            status=self.notifier.status)
                    ph.detail.update(plan=result.plan, steps=result.steps)
                loaded.warmup += result.steps
                loaded.plans.append(result.as_dict())
        return loaded.warmup

    async def _warm_targets(self, loaded: Loaded) -> list[Any]:
        """What to warm: models, then engines that ask for a warm-up. Each plan key needs the
        device identity, found on a thread while the first floor request runs."""
        from edge.warmplan import WarmTarget, engine_plan_key, model_plan_key
        from edge.warmup import check_prompts, engine_candidates, model_candidates, model_floor

        cfg, state = self.config, loaded.state
        identity = asyncio.ensure_future(asyncio.to_thread(_device_and_build, bool(state.workers)))

        async def model_key(w: Any) -> dict[str, Any]:
            lengths = await w.call(check_prompts, w.model, cfg.warmup)  # a prompt that cannot fit fails
            device, build = await identity
            return {**model_plan_key(w.model, device, build), "prompts": _digest(cfg.warmup.prompts),
                    "prompt_tokens": lengths}

        async def engine_key(stored: Any) -> dict[str, Any]:
            device, _ = await identity
            return engine_plan_key({**stored.key.as_dict(), "sha256": stored.sha256}, device)

        targets = []
        for name, w in state.workers.items():
            if name in loaded.kept:
                continue  # serving already, and warm: its thread belongs to clients
            make = functools.partial(w.call, model_candidates, w.model, cfg.warmup)
            targets.append(WarmTarget("model", name, functools.partial(model_key, w),
                                      model_floor(w.model, cfg.warmup), make, w.call))
        for name, eng in state.engines.items():
            if name not in loaded.kept and next(e for e in cfg.engines if e.name == name).warmup:
                cands = engine_candidates(name, eng.session)
                targets.append(WarmTarget("engine", name, functools.partial(engine_key, eng.stored),
                                          cands[0].build(), functools.partial(_ready, cands[1:]), _call))
        return targets

    def mark_ready(self, loaded: Loaded) -> str:
        """The moment traffic is handed over: the report is written, then READY=1 and the first
        accept() follow at once. Returns the READY status text."""
        from edge.serving import describe_socket

        loaded.state.ready = True
        addresses = [describe_socket(s) for s in self.sockets]
        now = self.timer.now()
        self.timer.add(Phases.READY, now, now, sockets=len(addresses))
        report = self.timer.report(config=self.config.source, sockets=addresses, models=loaded.infos,
                                   warmup=loaded.warmup, calibration=loaded.plans)
        path: Path = write_report(report, state_dir(self.config))
        loaded.state.metrics.set_phases(report["phases"])
        log.info("start report %s: ready in %.2f s", path, report["ready_s"],
                 extra={"START_REPORT": json.dumps(report), "READY_SECONDS": report["ready_s"]})
        return (f"ready: serving {', '.join(loaded.names)} on {', '.join(addresses)} "
                f"(start {report['ready_s']:.2f} s)")


def _device_and_build(llama: bool) -> tuple[Any, str | None]:
    from edge.device import detect
    from edge.llama_gpu import llama_build

    return detect(), (llama_build() if llama else None)


def _digest(prompts: list[str]) -> str:
    """The workload prompts in a plan key: new prompts are new candidates."""
    import hashlib

    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


async def _ready(value: Any) -> Any:
    return value


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()


# module -> (extra of edge that brings it, pip package, what needs it); the rest: plain imports
_BACKENDS = {"llama_cpp": (None, "llama-cpp-python", "loading GGUF models"),
             "onnxruntime": ("ort", "onnxruntime", "serving ONNX Runtime engines")}


def _import(names: list[str]) -> list[str]:
    for name in names:
        if name in _BACKENDS:
            extra, package, purpose = _BACKENDS[name]
            require(name, extra, purpose, package=package)
        else:
            importlib.import_module(name)
    return names


def _stop_during_start(sig: int, frame: Any) -> None:
    raise StoppedDuringStart("SIGTERM before ready")


def _done(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut
