"""Zero-gap reload: a new set is loaded and warmed beside the serving one, then takes over.

    RELOADING=1 → config → resolve/validate (GGUF headers) → memory guard → [sequential: hold new
    requests, drain and free the old set] → load (kept models are taken over, not reloaded) →
    warm-up over loopback HTTP → switch (one reference swap in the Dispatcher) → READY=1 →
    the old set drains (its in-flight requests and streams finish) → freed → reload report

It all happens in this process, on the serving event loop: the load runs in a thread and the
warm-up is async, so requests, the watchdog and the control socket stay live. Triggers: SIGHUP
(the config the service was started with), and the control socket that `edge reload` (and
ExecReload=, and the OTA activator) talks to (edge.lifecycle.control): one JSON request, one JSON answer
after the switch. A failed reload leaves the old set serving untouched and answers with the
error's exit code. docs/reload.md says why the new set is not a child process.

The new set is made by the start's own load-and-warm step (`edge.lifecycle.loader.Loader`); this module
takes the dispatcher (edge.lifecycle.serving) to switch to it, and never imports edge.lifecycle.start.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge.config import Config, state_dir
from edge.lifecycle.control import ControlServer, control_path
from edge.errors import ConfigError, EdgeError
from edge.lifecycle.loader import Loader, read_config
from edge.lifecycle.loadset import Loaded, LoadPlan, split_cores, threads_of
from edge.lifecycle.systemd import Notifier
from edge.timing import PhaseObserver, Phases, ReloadTimer, write_report

if TYPE_CHECKING:
    from edge.lifecycle.handover.handover import Handover
    from edge.lifecycle.memguard import Decision
    from edge.lifecycle.safemode import SafeMode
    from edge.lifecycle.serving import Dispatcher, Route

__all__ = ["Reloader"]

log = logging.getLogger("edge")

QUIET_S, QUIET_MAX_S = 0.25, 5.0  # the old set is freed after this long without requests (at most)

# [server] fields a reload cannot apply: they shape the sockets and the uvicorn server itself.
RESTART_ONLY = ("host", "port", "unix_socket", "unix_socket_mode", "backlog", "drain_timeout_s", "tls_cert_file",
                "tls_key_file")


class Reloader:
    """The reloads of one serving process, one at a time; `async with` opens the control socket
    and takes SIGHUP for as long as the service serves. `current` is the config in force,
    `started_from` the path a reload without one reads again; `stop_server` ends the service when
    a failed reload cannot bring the previous set back either."""

    def __init__(self, dispatcher: Dispatcher, current: Config, notifier: Notifier, *,
                 started_from: str | None, stop_server: Callable[[], None], safe_mode: SafeMode | None = None,
                 observers: list[PhaseObserver] | None = None, handover: Handover | None = None) -> None:
        self.dispatcher, self.current, self.notifier = dispatcher, current, notifier
        self.started_from, self.stop_server = started_from, stop_server
        # safe mode's steps apply to every set a reload makes; each reload's phases go to the
        # process's start journal too (a reload that dies is a crash in its phase)
        self.safe_mode, self.observers = safe_mode, list(observers or [])
        self.fatal: EdgeError | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: ControlServer | None = None
        self._making: asyncio.Task[Any] | None = None  # the reload now loading/warming, if any
        self.handover = handover  # to a new process (edge.lifecycle.handover.handover), where one is needed

    @property
    def busy(self) -> bool:
        """A reload is under way (loading, warming, switching or handing over)."""
        return self._lock.locked()

    @property
    def in_force(self) -> Config:
        """The config in force, as loaded: with safe mode's steps."""
        return self.safe_mode.apply(self.current)[0] if self.safe_mode else self.current

    # -- triggers ----------------------------------------------------------------------------
    async def __aenter__(self) -> "Reloader":
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.spawn, None, None)
        control = ControlServer(control_path(self.current), self.reload)
        try:
            await control.open()
            self._control = control
        except OSError as exc:  # reload by SIGHUP still works
            log.warning("no control socket at %s (%s): `edge reload` cannot reach this service; "
                        "SIGHUP still reloads", control.path, exc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # shutting down: a late SIGHUP is not a kill
        if self.handover is not None:  # stopping: a new process that has not taken over is ended
            self.handover.abandon()  # first, so that the answer to its `edge reload` need not wait
        if self._control is not None:
            self._control.close()
            await self._control.answered()  # a handover's answer, written after this process drained
        if self._making is not None:  # stopping: a set that never served is not worth waiting for
            self._making.cancel()
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)  # drains end (nothing is served now)

    def spawn(self, config: str | None, timeout: float | None) -> None:
        """A reload in the background (SIGHUP's way: no one waits for the answer)."""
        task = asyncio.get_running_loop().create_task(self.reload(config, timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one reload --------------------------------------------------------------------------
    async def reload(self, config: str | None, timeout: float | None, process: bool | None = None,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
        """Reload from `config` (None: the path the service was started with); the answer for
        `edge reload`, given once the new set serves (or the reload failed). A handover to a new
        process instead when `process`, or (None) when what is installed is not what runs."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except asyncio.TimeoutError:
            return _failed(EdgeError(f"another reload was still running after {timeout} s (--timeout)"))
        handed_on = False
        try:
            if self.dispatcher.stopping:
                return _failed(EdgeError("the service is stopping: no reload"))
            path = config if config is not None else self.started_from
            why = self.handover.reasons(env) if self.handover is not None and process is not False else []
            if self.handover is not None and (process or why):
                return await self.handover.run(path, timeout, env, why or ["edge reload --process"])
            run = _ReloadRun(self, path)
            self._making = asyncio.current_task()
            try:
                new = await asyncio.wait_for(run.make(), None if end is None else max(0.0, end - loop.time()))
                if self.dispatcher.stopping:  # SIGTERM came during the load: nothing more to say
                    await asyncio.to_thread(new.close, run.old)
                    return _failed(EdgeError("the service began stopping during the reload"))
            except asyncio.TimeoutError:
                return await run.failed(EdgeError(f"the reload did not finish within {timeout} s (--timeout)"))
            except EdgeError as exc:
                return await run.failed(exc)
            except Exception as exc:  # never let a reload take the serving set down
                return await run.failed(EdgeError(f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                self._making = None
            old = run.switch(new)
            task = loop.create_task(self._drain_then_release(run, old, new))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            handed_on = True
            return {"ok": True, "status": run.status, "exit_code": 0, "report": run.summary()}
        finally:
            if not handed_on:
                self._lock.release()

    async def _drain_then_release(self, run: _ReloadRun, old: Route, new: Loaded) -> None:
        try:
            await run.drain(old, new)
        finally:
            self._lock.release()


class _ReloadRun:
    """The state of one reload: its timer, its loader (made from the config it reads), its report."""

    def __init__(self, reloader: Reloader, path: str | None) -> None:
        self.r = reloader
        self.timer = ReloadTimer()
        self.timer.observers += reloader.observers
        self.path = path
        self._loader: Loader | None = None
        self.old = reloader.dispatcher.loaded
        self.decision: Decision | None = None
        self.cleared = False  # sequential: the old set was drained and freed before the load
        self.extra: dict[str, Any] = {"kept": [], "loaded": [], "freed": []}
        self.status = ""
        reloader.notifier.reloading(f"reloading {path or 'the start config'}")

    @property
    def loader(self) -> Loader:
        if self._loader is None:
            raise RuntimeError("make() first")
        return self._loader

    @property
    def config(self) -> Config:
        """The new config (read by `make`)."""
        return self.loader.config

    async def make(self) -> Loaded:
        cfg = await asyncio.to_thread(read_config, self.path, self.timer)
        self._loader = Loader(cfg, self.timer, self.r.notifier, safe_mode=self.r.safe_mode)
        self.extra["config"] = cfg.source
        self.extra["needs_restart"] = [f"server.{f}" for f in RESTART_ONLY
                                       if getattr(cfg.server, f) != getattr(self.r.current.server, f)]
        self._check_exposure(cfg)
        plan = await asyncio.to_thread(self.loader.prepare, self.old)
        self.extra["kept"] = list(plan.kept)
        self.extra["loaded"] = [f.cfg.name for f in plan.files] + [e.name for e in plan.engines]
        with self.timer.phase(Phases.MEMORY_GUARD) as ph:
            self.decision = await asyncio.to_thread(_guard, self.loader.config, plan, self.old)
            ph.detail.update(mode=self.decision.mode, reason=self.decision.reason)
        if self.decision.mode == "sequential":
            await self._clear_room(plan)
        new = await self._load(plan)
        try:
            await self._warm(new)
        except BaseException:
            await asyncio.to_thread(new.close, self.old)
            raise
        return new

    def _check_exposure(self, cfg: Config) -> None:
        """The new keys (read now: a rotation takes effect with this reload) must still cover
        every socket others can reach, as at the start; else the reload fails (78) and the old
        set keeps serving with its keys."""
        from edge.serve.auth import exposure_problem

        for address in self.r.dispatcher.exposed:
            problem = exposure_problem(f"the listening socket {address}", self.loader.auth, cfg.server)
            if problem:
                raise ConfigError(cfg.source, "server.api_key_file", problem)

    async def _warm(self, new: Loaded) -> None:
        """The start's warm-up. Overlapping, the cores are split for its duration
        (edge.lifecycle.loadset.split_cores): the new models warm up on a quarter of them, the
        serving ones run on the rest, and every thread count is back before the switch."""
        if self.decision is None or self.decision.mode != "overlap":
            return await self.loader.warm(new)
        warm_n, serve_n = split_cores()
        fresh = [w for n, w in new.state.workers.items() if n not in new.kept]
        serving = list(self.old.state.workers.values())
        self.extra["warmup_threads"] = warm_n
        self.extra["serving_threads_while_warming"] = serve_n
        split = asyncio.ensure_future(threads_of(serving, serve_n))  # queued behind the serving requests
        try:
            await threads_of(fresh, warm_n)
            await self.loader.warm(new)
        finally:
            await split
            await threads_of(fresh + serving, None)

    async def _clear_room(self, plan: LoadPlan) -> None:
        """Sequential: park new requests in the dispatcher, let the old set finish what it has,
        and free what the new set does not take over."""
        self.r.notifier.status(f"reloading sequentially: {self.decision.reason if self.decision else ''}")
        with self.timer.phase(Phases.DRAIN_OLD) as ph:
            self.r.dispatcher.hold()
            self.cleared = True
            ph.detail["drained"] = await self.r.dispatcher.route.drained(self.config.server.drain_timeout_s)
            self.extra["freed"] = await asyncio.to_thread(self.old.close, self.old.only(list(plan.kept)))
            _collect()

    async def _load(self, plan: LoadPlan) -> Loaded:
        # A timeout cancels the wait, not the thread: what it loads is freed when it ends.
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self.loader.load, plan, self.old.state.metrics)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            old = self.old
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else
                                  loop.run_in_executor(None, f.result().close, old))  # not on the loop
            raise

    def switch(self, new: Loaded) -> Route:
        for name in new.kept:  # a kept model takes the new queue bound (stream interval, request limit) once it is the new set's
            worker = new.state.workers.get(name)
            if worker is not None:
                worker.max_queue = self.config.server.max_queue
                worker.stream_interval_s = self.config.server.stream_interval_ms / 1000
                worker.request_timeout_s = self.config.server.request_timeout_s
                worker.model.adapters = new.state.adapters_of(worker)  # what its reports show from now on
        from edge.serve.auth import served_open

        at = self.timer.now()
        old = self.r.dispatcher.switch(new)
        new.state.metrics.served_without_keys(served_open(self.r.dispatcher.exposed, new.state.auth), "reload")
        self.timer.add(Phases.SWITCH, at, at)
        self.r.current = self.loader.read
        self.extra.update(switch_s=round(at, 4), models=new.infos, warmup=new.warmup, drain_s=None)
        self.status = (f"ready: serving {', '.join(new.names)} (reloaded from {self.extra['config']} in "
                       f"{at:.2f} s, {self.decision.mode if self.decision else '?'})")
        self._write()
        self.r.notifier.ready(self.status)
        if self.extra["needs_restart"]:
            log.warning("reload: %s changed; applied at the next restart", ", ".join(self.extra["needs_restart"]))
        return old

    async def drain(self, old: Route, new: Loaded) -> None:
        """The old set finishes its in-flight requests (streams included), then is freed."""
        with self.timer.phase(Phases.DRAIN) as ph:
            limit = self.config.server.drain_timeout_s
            drained = await old.drained(limit)
            ph.detail.update(drained=drained, in_flight=old.active)
            if not drained:  # freed when its last request ends; reported now
                log.warning("reload: %d requests of the old set still running after %.0f s", old.active, limit)
                await old.drained(None)
            # Freeing the old set (llama.cpp contexts and mappings, a full GC) takes a core for
            # ~0.1 s: done once the new set has been quiet a moment, not under its first requests.
            ph.detail["quiet"] = await self.r.dispatcher.route.quiet(QUIET_S, QUIET_MAX_S)
            t0 = time.perf_counter()
            self.extra["freed"] += await asyncio.to_thread(old.loaded.close, new)
            t1 = time.perf_counter()
            _collect()
            ph.detail.update(close_s=round(t1 - t0, 4), gc_s=round(time.perf_counter() - t1, 4))
        self.extra["drain_s"] = round(ph.seconds, 4)
        self._write()
        log.info("reload done: kept %s, loaded %s, freed %s; old set drained in %.3f s",
                 self.extra["kept"], self.extra["loaded"], self.extra["freed"], ph.seconds)

    async def failed(self, exc: EdgeError) -> dict[str, Any]:
        """The old set keeps serving (or, after a sequential drain, is loaded again)."""
        self.extra["error"] = str(exc)
        log.error("reload failed: %s", exc)
        if self.cleared:
            await self._roll_back()
        if self.r.fatal is None:
            self._write()
            if not self.r.dispatcher.stopping:  # after STOPPING=1, no READY=1
                self.r.notifier.send(f"READY=1\nSTATUS=reload failed: {exc}")
        return {**_failed(exc), "report": self.summary()}

    async def _roll_back(self) -> None:
        loader = Loader(self.r.current, self.timer, self.r.notifier, safe_mode=self.r.safe_mode)
        try:
            plan = await asyncio.to_thread(loader.prepare, self.old.only(self.extra["kept"]))
            back = await asyncio.to_thread(loader.load, plan, self.old.state.metrics)
            await loader.warm(back)
        except Exception as exc:
            self.r.fatal = exc if isinstance(exc, EdgeError) else EdgeError(f"{type(exc).__name__}: {exc}")
            self.extra["error"] += f"; loading the previous set again failed too: {exc}"
            self._write()
            self.r.notifier.status(f"reload failed, previous set lost: {exc}; stopping")
            self.r.stop_server()
            return
        self.r.dispatcher.switch(back)
        self.extra["rolled_back"] = True

    def summary(self) -> dict[str, Any]:
        d = self.decision
        return {"config": self.extra.get("config", self.path), "mode": d.mode if d else None,
                "memory": d.as_dict() if d else None, "kept": self.extra["kept"],
                "loaded": self.extra["loaded"], "switch_s": self.extra.get("switch_s"),
                "needs_restart": self.extra.get("needs_restart", []), "error": self.extra.get("error")}

    def _write(self) -> None:
        report = self.timer.report(**{**self.extra, **self.summary()}, kind="reload")
        try:
            write_report(report, state_dir(self.r.current), kind="reload")
        except OSError as exc:
            log.warning("cannot write the reload report: %s", exc)


def _guard(cfg: Config, plan: LoadPlan, old: Loaded) -> Decision:
    """The memory guard's decision for this plan (docs/reload.md, edge.lifecycle.memguard)."""
    from edge.device.memory import read_memory
    from edge.lifecycle.memguard import decide, engine_sizes, estimate, oom_before

    mapped = {k[2] for k in old.keys.values() if k[0] == "model" and k[2]}
    need = estimate([(f.cfg, f.info, plan.keys[f.cfg.name][2] in mapped) for f in plan.files if f.info],
                    engines=engine_sizes(cfg, plan.engines))
    reading = None
    if cfg.server.reload == "auto":
        reading = read_memory(gpu=any(f.cfg.n_gpu_layers != 0 for f in plan.files))
    return decide(cfg.server.reload, need, reading, oom_before(state_dir(cfg)) if reading is not None else None)


def _collect() -> None:
    # The start froze what lived at READY (gc.freeze): unfreeze so the old set can be collected.
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _failed(exc: EdgeError) -> dict[str, Any]:
    return {"ok": False, "error": str(exc), "exit_code": exc.exit_code}
