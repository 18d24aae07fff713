"""The load-and-warm step a start, a rehearsal (`edge warmup`) and a reload share: from a config
to a loaded, warmed set, each step a phase of the report (named in `edge.timing.Phases`):

    prepare: resolve_models → page_in threads ‖ validate (GGUF headers, from the warming pages)
    load:    imports (backends) → page_in and validate joined (sha256 checked)
             → model_load + mlock_verify ‖ imports_http → engines (device, lookup, read, deserialize)
             → prefix_states (declared and learned prefixes into each new model's prompt cache)
    warm:    warmup_setup → warmup (per model and engine: the floor request, then the stored plan
             or a calibration that makes one)

A `Loader` is made from a config, a timer and a notifier and touches no socket: `edge.lifecycle.start`
serves the set it makes, `edge.lifecycle.reload` makes each new set with it beside the serving one
(`prepare(previous)` takes over the workers whose model is unchanged). It makes the types of
`edge.lifecycle.loadset` and imports none of start, reload or serving.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge.config import Config, EngineConfig, ModelConfig, cache_dir, check_writable, find_config, load_config
from edge.lifecycle.loadset import Loaded, LoadPlan, close_worker, model_key
from edge.lifecycle.systemd import Notifier, setup_logging
from edge.timing import Phases, StartTimer

if TYPE_CHECKING:
    import concurrent.futures

    from edge.lifecycle.safemode import SafeMode
    from edge.model.gguf import GGUFInfo
    from edge.lifecycle.loadset import Validation
    from edge.serve.auth import ApiKeys
    from edge.serve.metrics import Metrics
    from edge.model.file import ModelFile
    from edge.lifecycle.warmup.plan import WarmTarget
    from edge.serve.worker import ModelWorker

__all__ = ["LOAD_SWITCH_INTERVAL_S", "Loader", "read_config"]

# What loading a model imports of edge's own, imported before the load thread starts rather than
# on it, where they would share the GIL with the HTTP stack's imports.
_MODEL_MODULES = ["edge.model.llm"]
# The GIL's switch interval while models load beside the imports: llama.cpp logs each line of a
# load (about 760 for Gemma 3) through edge's callback, which takes the GIL, and a thread asking
# for it waits up to the interval (5 ms) while this one imports: a 0.55 s load took 2.15 s beside
# a busy thread at 5 ms, 0.58 s at 50 µs (the project's 2-core VM).
LOAD_SWITCH_INTERVAL_S = 50e-6


def read_config(path: str | None, timer: StartTimer) -> Config:
    """The config phase: the file at `path` (else the one the lookup order finds), validated, its
    folders proven writable before the load rather than at READY; logging set to its level."""
    with timer.phase(Phases.CONFIG):
        cfg = load_config(find_config(path))
        check_writable(cfg)
    setup_logging(cfg.server.log_level)
    return cfg


class Loader:
    """Loaded, warmed sets made from one config: `prepare()` → `load(plan)` → `warm(loaded)`."""

    def __init__(self, cfg: Config, timer: StartTimer, notifier: Notifier, *, recalibrate: bool = False,
                 safe_mode: SafeMode | None = None, at_start: bool = False) -> None:
        # safe mode's steps in force (edge.lifecycle.safemode): the config as it will be loaded
        self.config, self.left_out = safe_mode.apply(cfg) if safe_mode else (cfg, {})
        self.read = cfg  # the config as read, before those steps
        self.safe_mode = safe_mode
        self.timer = timer
        self.notifier = notifier
        self.recalibrate = recalibrate  # `edge warmup --calibrate`: measure anew whatever is stored
        self.at_start = at_start  # a process's own start: its load's log in memory, its imports frozen for the GC

    @functools.cached_property
    def auth(self) -> ApiKeys | None:
        """The API keys the config (or the unit's credential) gives, read once per loader: at
        the start's sockets phase, and for each reload's new set. A rehearsal sets None."""
        from edge.serve.auth import load_api_keys

        return load_api_keys(self.read.server, self.read.source)

    # -- prepare ------------------------------------------------------------------------------------
    def prepare(self, previous: Loaded | None = None) -> LoadPlan:
        """Resolve every model file; take over what `previous` already has loaded the same way;
        start the page-in of the others and validate them from the warming pages: on a thread
        beside the backend imports at a start (`finish_model_files` joins it), at once for a
        reload (its memory guard reads every header)."""
        from edge.model.file import ModelFile, VerifiedCache, resolve_model

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
        plan.validations = self._validations(plan.files, now=previous is not None)
        for e in cfg.engines:
            plan.keys[e.name] = ("engine", e)
            if before.get(e.name) == plan.keys[e.name]:
                plan.kept[e.name] = old[e.name]
            else:
                plan.engines.append(e)
        if previous:
            plan.kept_infos = {n: i for n, i in zip(previous.names, previous.infos) if n in plan.kept}
        return plan

    def _validations(self, files: list[ModelFile], now: bool) -> list[Validation]:
        if now:
            return [_done(self._validate(f)) for f in files]
        import concurrent.futures  # after the config: each import before it is on every start's path

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-validate")
        running = [pool.submit(self._validate, f) for f in files]
        pool.shutdown(wait=False)  # the queued validations still run; joined by finish_model_files
        return running

    def _validate(self, f: ModelFile) -> tuple[float, float, GGUFInfo]:
        start = self.timer.now()
        info = f.validate()
        return start, self.timer.now(), info

    # -- load ---------------------------------------------------------------------------------------
    def load(self, plan: LoadPlan | None = None, metrics: Metrics | None = None) -> Loaded:
        """Model files, backends, models and engines: the load half of load-and-warm. A reload
        passes the plan it made (`prepare(previous)`) and the metrics that carry over."""
        plan = plan or self.prepare()
        self.import_backends(plan)
        self.finish_model_files(plan)
        made: dict[str, Any] = {}  # closed again if a later step fails: nothing loaded is left behind
        try:
            workers, infos = self.load_models_beside_http(plan.files, made)
            engines, engine_infos = self.load_engines(plan.engines)
            made.update(engines)
            self.restore_prefixes(workers)
            from edge.lifecycle.adapters import load_kept  # after the config: not on a start's early path
            plan.adapters = load_kept(self.config, plan)  # a kept model's new adapters
            return self.assemble(plan, made, {**infos, **engine_infos}, metrics)
        except BaseException:
            for worker in made.values():
                close_worker(worker)
            raise

    def import_backends(self, plan: LoadPlan) -> None:
        """llama_cpp's bindings (and onnxruntime) imported beside the page-in threads: what a
        model's load needs; the rest of llama_cpp comes beside the load (`import_http`)."""
        from edge.lifecycle.backends import import_modules

        with self.timer.phase(Phases.IMPORTS) as ph:
            self.notifier.status("importing the inference backends")
            ph.detail["modules"] = import_modules((["llama_cpp.llama_cpp", *_MODEL_MODULES] if plan.files else []) + (
                ["onnxruntime"] if any(e.backend == "onnxruntime" for e in plan.engines) else []))

    def finish_model_files(self, plan: LoadPlan) -> None:
        """Join the validations and page-ins (their real start and end in the report); check the
        sha256. A file that fails validation raises here, before llama.cpp sees it."""
        for f, done in zip(plan.files, plan.validations):
            start, end, info = done.result()
            ph = self.timer.add(Phases.VALIDATE, start, end, nbytes=info.size, model=f.cfg.name)
            ph.detail.update(info.summary(), **({"header": "as validated before (same file identity)"}
                                                 if f.validated_earlier else {}))
        mono0 = time.monotonic() - self.timer.now()
        for f in plan.files:
            res = f.finish()
            if res is not None:
                self.timer.add(Phases.PAGE_IN, res.start_s - mono0, res.end_s - mono0, nbytes=res.bytes,
                               model=f.cfg.name, threads=f.pagein.threads if f.pagein else 0,
                               **res.as_detail())

    def load_models_beside_http(self, files: list[ModelFile], made: dict[str, Any]
                                ) -> tuple[dict[str, ModelWorker], dict[str, Any]]:
        """llama.cpp loads with the GIL released: the HTTP stack is imported meanwhile, with a
        short switch interval (its log callback takes the GIL some 760 times a load)."""
        import concurrent.futures
        import sys

        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, LOAD_SWITCH_INTERVAL_S))
        try:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-load") as pool:
                loading = pool.submit(self.load_models, files, made)
                self.import_http()
                if self.at_start:  # while the load runs: the collect before READY scans only what came since
                    import gc

                    gc.collect()
                    gc.freeze()
                return loading.result()
        finally:
            sys.setswitchinterval(interval)

    def import_http(self) -> None:
        """While the models load (the GIL released): llama_cpp's high-level half (chat formats,
        numpy; edge.model.bindings), then the HTTP stack."""
        from edge.lifecycle.backends import LAZY_FIRST_REQUEST, complete_llama_cpp, import_modules

        with self.timer.phase(Phases.IMPORTS_HTTP) as ph:
            ph.detail["modules"] = complete_llama_cpp() + import_modules(
                ["uvicorn", "starlette.applications", "edge.serve.app", "edge.lifecycle.serving"], LAZY_FIRST_REQUEST)

    def load_models(self, files: list[ModelFile], made: dict[str, Any]
                    ) -> tuple[dict[str, ModelWorker], dict[str, Any]]:
        """Each model through llama.cpp (mmap, mlock), then the lock measured and the policy
        applied; each worker in `made` as soon as it exists."""
        from edge.lifecycle.memguard import need_mib
        from edge.model.llm import check_settings, load_gguf_model

        workers, infos = {}, {}
        for f in files:
            m = f.cfg
            info = f.validate() if f.info is None else f.info
            check_settings(m, info, self.config)  # what llama.cpp would refuse for this file: exit 78
            self.notifier.status(f"loading {m.name} ({m.path})")
            with self.timer.phase(Phases.MODEL_LOAD, model=m.name, use_mmap=m.use_mmap, use_mlock=m.use_mlock,
                                  **_bufts(m)) as ph:
                model = load_gguf_model(m, info, self.at_start, f"models[{[c.name for c in self.config.models].index(m.name)}]")
                ph.bytes = model.info.size
            from edge.serve.worker import ModelWorker  # after the load: its asyncio is imported by then

            made[m.name] = workers[m.name] = ModelWorker(model, self.config.server.max_queue,
                                                         self.config.server.stream_interval_ms / 1000,
                                                         self.config.server.request_timeout_s)
            with self.timer.phase(Phases.MLOCK_VERIFY, model=m.name) as ph:
                ph.detail.update(model.mlock.as_dict())
                from edge.model.mlock import enforce

                enforce(m, model.mlock)
            infos[m.name] = {**model.info.summary(), "name": m.name, "path": m.path, "n_ctx": model.n_ctx,
                             "context": model.context_info(), "mlock": model.mlock.as_dict(),
                             "memory_mib": need_mib(m, model.info)}
        return workers, infos

    def load_engines(self, engines: list[EngineConfig]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Each engine from the store (edge.lifecycle.engines times its own phases)."""
        if not engines:  # the engine modules (numpy, the store) are imported only for engines
            return {}, {}
        from edge.lifecycle.engines import load_engines

        workers, infos = load_engines(self.config, self.timer, only=engines)
        return workers, dict(zip(workers, infos))

    def restore_prefixes(self, workers: dict[str, ModelWorker]) -> None:
        """Each new model's declared (and learned) prefixes into its prompt cache, on its worker
        thread: read from disk, or prefilled and saved when their key is new (or recalibrate)."""
        from edge.model.prefixstore import folder_for, restore_prefixes

        cfg = self.config
        for i, m in enumerate(cfg.models):
            w = workers.get(m.name)
            if w is None or not (m.prefixes or m.learn_prefixes):
                continue
            self.notifier.status(f"restoring the prefix states of {m.name}")
            with self.timer.phase(Phases.PREFIX_STATES, model=m.name) as ph:
                rows = w.run(restore_prefixes, w.model, folder_for(cache_dir(cfg), m.name), cfg.source,
                             f"models[{i}]", self.recalibrate)
                ph.bytes = sum(r["bytes"] for r in rows if r["outcome"] != "ignored")
                ph.detail["prefixes"] = rows

    def assemble(self, plan: LoadPlan, made: dict[str, Any], infos: dict[str, Any],
                 metrics: Metrics | None) -> Loaded:
        """The set in the config's order, what was made now beside what was taken over, and the
        app over it."""
        from edge.serve.app import ServiceState, build_app

        pick = {**plan.kept, **made}
        by_name = {**infos, **{n: {**i, "kept": True} for n, i in plan.kept_infos.items()}}
        state = ServiceState(workers={m.name: pick[m.name] for m in self.config.models},
                             engines={e.name: pick[e.name] for e in self.config.engines}, left_out=self.left_out,
                             safe_mode=self.safe_mode.describe() if self.safe_mode else [], auth=self.auth,
                             adapters=plan.adapters)
        if metrics is not None:
            state.metrics = metrics
        return Loaded(build_app(state), state, [by_name[n] for n in [*state.workers, *state.engines]],
                      keys=plan.keys, kept=list(plan.kept))

    # -- warm ---------------------------------------------------------------------------------------
    async def warm(self, loaded: Loaded, defer: bool = False) -> list[dict[str, Any]]:
        """The warm half of load-and-warm: for each model and engine the floor request, then its
        stored plan (known key) or a calibration that makes one (new key), over HTTP to this process alone.
        `defer` (a start): calibrations `[warmup] calibrate` puts after READY go to `loaded.later`."""
        from edge.lifecycle.adapters import warm as warm_adapters
        from edge.lifecycle.warmup.plan import PlanStore, warm_one
        from edge.lifecycle.warmup.steps import LoopbackHTTP

        cfg = self.config
        store = PlanStore(cache_dir(cfg) / "warmup")
        with self.timer.phase(Phases.WARMUP_SETUP):  # what to warm; uvicorn's protocol made ready
            targets = await self._warm_targets(loaded)
            http = LoopbackHTTP(loaded.app)  # no listener: a socket pair per request, closed with it
        async with http:
            for target in targets:
                self.notifier.status(f"warming up {target.name}")
                with self.timer.phase(Phases.WARMUP, **{target.kind: target.name}, **self._bufts_of(target)) as ph:
                    result = await warm_one(http, target, cfg.warmup, store, recalibrate=self.recalibrate,
                                            defer=defer, status=self.notifier.status)
                    ph.detail.update(plan=result.plan, steps=result.steps)
                loaded.warmup += result.steps
                loaded.plans.append(result.as_dict())
                loaded.later += [result.later] if result.later else []
            loaded.warmup += await warm_adapters(loaded.state)  # each adapter: a short generation with it
        return loaded.warmup

    def _bufts_of(self, target: WarmTarget) -> dict[str, Any]:
        m = next((m for m in self.config.models if target.kind == "model" and m.name == target.name), None)
        return _bufts(m) if m else {}

    async def _warm_targets(self, loaded: Loaded) -> list[WarmTarget]:
        """What to warm: models, then engines that ask for a warm-up. Each plan key needs the
        device identity, found on a thread while the first floor request runs."""
        from edge.lifecycle.warmup.plan import WarmTarget, engine_plan_key, model_plan_key
        from edge.lifecycle.warmup.steps import check_prompts, engine_candidates, model_candidates, model_floors

        import asyncio

        cfg, state = self.config, loaded.state
        identity = asyncio.ensure_future(asyncio.to_thread(_device_and_build, bool(state.workers)))

        async def key_of_model(w: Any) -> dict[str, Any]:
            lengths = await w.call(check_prompts, w.model, cfg.warmup, cfg.source)  # a prompt that cannot fit fails
            device, build = await identity
            return {**model_plan_key(w.model, device, build), "prompts": _digest(cfg.warmup.prompts),
                    "prompt_tokens": lengths}

        async def key_of_engine(stored: Any) -> dict[str, Any]:
            device, _ = await identity
            return engine_plan_key({**stored.key.as_dict(), "sha256": stored.sha256}, device)

        targets = []
        for name, w in state.workers.items():
            if name in loaded.kept:  # serving already, and warm: its thread belongs to clients,
                await w.call(check_prompts, w.model, cfg.warmup, cfg.source)  # but the prompts must fit
                continue
            make = functools.partial(w.control, model_candidates, w.model, cfg.warmup)  # no client request
            floor, also = model_floors(w.model, cfg.warmup)  # the completion's, and the embeddings' where it has them
            targets.append(WarmTarget("model", name, functools.partial(key_of_model, w), floor, make, w.control, also))
        for name, eng in state.engines.items():
            if name not in loaded.kept and next(e for e in cfg.engines if e.name == name).warmup:
                cands = engine_candidates(name, eng.session)
                targets.append(WarmTarget("engine", name, functools.partial(key_of_engine, eng.stored),
                                          cands[0].build(), functools.partial(_ready, cands[1:]), _call))
        return targets


def _device_and_build(llama: bool) -> tuple[Any, str | None]:
    from edge.device.identity import detect
    from edge.model.gpu import llama_build

    return detect(), (llama_build() if llama else None)


def _bufts(m: ModelConfig) -> dict[str, Any]:
    """In a phase's detail only when off: llama.cpp's extra buffer types (safe mode's first step)."""
    return {} if m.use_extra_bufts else {"extra_bufts": False}


def _digest(prompts: list[str]) -> str:
    """The workload prompts in a plan key: new prompts are new candidates."""
    import hashlib
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


async def _ready(value: Any) -> Any:
    return value


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()


def _done(value: Any) -> concurrent.futures.Future[Any]:
    import concurrent.futures
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut
