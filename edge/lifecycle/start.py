"""The cold start: what `edge serve` does from exec to READY=1, in the order it happens.

Read `ColdStart.run()` top to bottom to learn what a start is (DESIGN.md, "The path of a
start"); every step is a timed phase of the start report, named once in `edge.timing.Phases`:

    config → recovery → sockets → resolve_models → page_in ‖ validate ‖ imports → model_load ‖ imports_http
    → mlock_verify → engines → prefix_states → warmup (floor, then the stored plan or a calibration) → http_setup
    → ready → serve (until SIGTERM, then drain)

Each phase is written to the start journal before it runs, and however the process ends the
journal and the reports say how (edge.lifecycle.recovery): "recovery" settles earlier
processes' crash records and takes safe mode's steps (edge.lifecycle.safemode).

The sockets are listening before anything slow happens, so a connection made at any point of
the start waits in the kernel's backlog and is accepted only once warm-up is done.

The load-and-warm step (model files, backends, models, engines, warm-up) is `edge.lifecycle.loader.Loader`,
made from the config this start reads; `rehearse()` (`edge warmup`) runs it without sockets, and
the reloader (edge.lifecycle.reload) uses it for every new set. This module is the top of the lifecycle: it
takes the reloader and the dispatcher (edge.lifecycle.serving); nothing below imports it.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.config import Config, state_dir
from edge.errors import EX_SAFE_MODE_EXHAUSTED, EX_SOFTWARE, EdgeError, StoppedDuringStart
from edge.bytecode import CompileWatch
from edge.lifecycle.installed import Running
from edge.lifecycle.loader import Loader, read_config
from edge.lifecycle.loadset import save_learned
from edge.lifecycle.loadset import Loaded, split_cores, threads_of
from edge.lifecycle.recovery import GivenUp, Recovery
from edge.lifecycle.safemode import SafeMode
from edge.lifecycle.signals import StartSignals
from edge.lifecycle.systemd import Notifier, listen_sockets
from edge.timing import Phases, StartTimer, write_report

if TYPE_CHECKING:
    import asyncio
    import socket

    from edge.lifecycle.handover.handover import Handover
    from edge.lifecycle.handover.successor import Takeover
    from edge.lifecycle.reload import Reloader
    from edge.lifecycle.serving import Dispatcher
    from edge.serve.tls import TlsFiles

__all__ = ["ColdStart"]

log = logging.getLogger("edge")


@dataclass
class _Service:
    """What serves once a start is warm: the dispatcher in front of the loaded set, uvicorn's
    server, and the two ways the set changes while serving."""

    dispatcher: Dispatcher
    server: Any
    handover: Handover
    reloader: Reloader


class ColdStart:
    """One start of the service: the config, the timer, the notifier, the sockets, what was loaded."""

    def __init__(self, config_path: str | None = None, *, timer: StartTimer | None = None,
                 takeover: Takeover | None = None, compiled: CompileWatch | None = None) -> None:
        self.timer = timer or StartTimer()  # offsets from exec, whenever it is made
        self.compiled = compiled  # the source files compiled since exec (edge.bytecode)
        self.config_path = config_path
        # started by a running edge to take over from it (edge.lifecycle.handover): its pipe and priority
        self.takeover = takeover
        self.takes_over = takeover is not None and takeover.takes_over
        self.notifier = takeover.notifier() if takeover is not None else Notifier()
        self.running = Running.now()  # what this process runs, before anything changes its environment
        self.handed_over_to: int | None = None  # the process this one handed the service to
        self.drain_end: dict[str, int] = {}  # requests the drain's limit ended (the journal's end says so)
        self._loader: Loader | None = None  # made from the config, once it is read
        self.sockets: list[socket.socket] = []
        self.tls: TlsFiles | None = None  # the certificate and key the sockets serve TLS with
        self.exposed: list[str] = []  # the sockets others can reach (edge.serve.auth.check_exposure)
        self.loaded: Loaded | None = None
        # Test hook: called with the loaded set just before the warm-up, so that a test can put a
        # double at the backend boundary (a wrapper around a model's native object); None in service.
        self.before_warm: Callable[[Loaded], None] | None = None
        self.signals = StartSignals()  # SIGTERM and SIGHUP before READY (a SIGHUP: reload once serving)
        self.recovery: Recovery | None = None  # the journal and safe mode of a real start (not a rehearsal)
        self.gpu_lost: str | None = None  # why the service left while serving (a lost CUDA context)
        self.report: tuple[dict[str, Any], Path] | None = None  # the start report and its file, once READY
        self.calibrating: asyncio.Task[None] | None = None  # the warm-up's calibration after READY

    # -- the start, top to bottom ----------------------------------------------------------------
    def run(self) -> int:
        """Start, warm up, serve until SIGTERM/SIGINT, drain; the exit code. However it ends by
        itself, its journal says so (and a start that never reached READY leaves its report)."""
        self.recovery = Recovery(self.config_path, self.timer, kind="handover" if self.takes_over else "start")
        given_up: GivenUp | None = None
        code = 0
        try:
            code = self._run()
        except GivenUp as exc:
            given_up = exc
        except StoppedDuringStart:
            if self.loaded is not None:
                self.loaded.close()  # lets a cancelled warm-up generation end first
            log.info("stopped by SIGTERM before ready")
            self._ended_before_ready("stopped", 0, "stopped by SIGTERM before ready")
            return 0
        except BaseException as exc:
            code = exc.exit_code if isinstance(exc, EdgeError) else EX_SOFTWARE
            if self.ready:
                self.recovery.ended(code)
            else:
                self._ended_before_ready("failed", code, str(exc) or type(exc).__name__)
            raise
        if given_up is not None:  # outside the except block: no exception is "being handled" meanwhile
            return self._answer_given_up(given_up)
        self.recovery.ended(code, **({"handed_over_to": self.handed_over_to} if self.handed_over_to else {}),
                            **self.drain_end)
        return code

    def _run(self) -> int:
        self.read_config()
        self.open_sockets()
        self.signals.install()
        self.notifier.extend_while()
        self.loaded = self.loader.load()
        import asyncio  # here, not before the config: it costs a start ~25 ms of imports (docs/internals.md, "Cold start")

        return asyncio.run(self._warm_and_serve(self.loaded))

    @property
    def ready(self) -> bool:
        return self.loaded is not None and self.loaded.state.ready

    def _ended_before_ready(self, result: str, code: int, error: str) -> None:
        """The report of a start that never reached READY (phases so far, why, the exit code)."""
        report = self.timer.report(config=self.config.source if self.config_read else self.config_path,
                                   error=error, exit_code=code)
        if self.recovery is not None:
            self.recovery.failed(report, result)

    async def _warm_and_serve(self, loaded: Loaded) -> int:
        """After the load, in the order of uvicorn's Server (startup, main loop, shutdown): the
        warm-up, the HTTP server set up, READY, serving until the drain ends, and what the end
        leaves (a handover's, a lost GPU's, or a plain stop's exit code)."""
        stop = await self.signals.unless_stopped(self._warm(loaded))
        service = self._set_up_http(loaded)
        if stop.is_set():
            raise StoppedDuringStart("SIGTERM before ready")
        ready_text = self.mark_ready(loaded)
        await self._serve(service, loaded, stop, ready_text)
        return self._shut_down(service)

    def _set_up_http(self, loaded: Loaded) -> _Service:
        """The http_setup phase: the dispatcher in front of the loaded set, uvicorn's server, and
        the two ways the set changes while serving (a reload, a handover to a new process)."""
        from edge.lifecycle.handover.handover import Handover
        from edge.lifecycle.reload import Reloader
        from edge.lifecycle.drain import leave
        from edge.lifecycle.serving import Dispatcher, build_server

        with self.timer.phase(Phases.HTTP_SETUP):
            self.running.note_libraries()  # llama.cpp's libraries as they are on disk, now that they are loaded
            dispatcher = Dispatcher(loaded)  # a reload swaps the set behind it
            dispatcher.exposed = self.exposed
            server = build_server(dispatcher, self.config.server, self.notifier, tls=self.tls)
            dispatcher.on_fatal = lambda reason: leave(server, reason)
            handover = Handover(server, self.sockets, self.notifier, self.running, self.loader.read,
                                serving=lambda: list(dispatcher.loaded.state.workers.values()))
            reloader = Reloader(dispatcher, self.loader.read, self.notifier, started_from=self.config_path,
                                stop_server=lambda: server.handle_exit(signal.SIGTERM, None),
                                safe_mode=self.loader.safe_mode, handover=handover,
                                observers=self.recovery.observers if self.recovery else [])
            gc.collect()
            gc.freeze()  # warm-up garbage is gone; what lives now is never scanned again
        return _Service(dispatcher, server, handover, reloader)

    async def _serve(self, service: _Service, loaded: Loaded, stop: asyncio.Event, ready_text: str) -> None:
        """Serve until the drain ends (SIGTERM, a lost GPU, a handover): a SIGHUP that came during
        the start reloads now; client requests are counted from before the first accept for the
        calibration after READY; the memory fallback's new start waits for this one's drain."""
        import asyncio

        from edge.lifecycle.serving import serve_http
        from edge.lifecycle.warmup.after_ready import Watch, stop_after_ready

        if self.recovery is not None:
            asyncio.get_running_loop().call_later(self.config.server.healthy_after_s, self.recovery.healthy)
        dispatcher, reloader = service.dispatcher, service.reloader
        async with reloader:
            if self.signals.hup_pending:  # SIGHUP during the start: the config may have changed since
                reloader.spawn(None, None)
            watch = Watch(list(loaded.state.workers.values()),
                          lambda: dispatcher.stopping or reloader.busy or dispatcher.loaded is not loaded)
            if self.takeover is not None:  # a handover's new process: what the old one passes on, served here
                self.takeover.take_connections(service.server)
            try:
                await serve_http(service.server, self.sockets, self.notifier, ready_text, stop,
                                 on_ready=lambda: self._serving(loaded, watch))
            finally:
                await stop_after_ready(self.calibrating)
            if service.handover.restart is not None:  # the memory fallback: drained; now the new start
                await service.handover.after_drain(dispatcher.loaded)

    def _shut_down(self, service: _Service) -> int:
        """What the end of serving leaves: a handover's exit, a lost GPU's 70 (nothing saved or
        closed: each would be work on the lost context), or the learned prefixes saved, the set
        closed and 0 (or the reloader's fatal code)."""
        handover, dispatcher = service.handover, service.dispatcher
        drain = service.server.drain
        self.drain_end = {k: v for k, v in (("ended_at_limit", drain.ended_at_limit), ("cut_at_limit", drain.cut)) if v}
        if handover.restart is not None or handover.successor_pid is not None:
            return self._handed_over(handover, dispatcher.loaded)
        if dispatcher.fatal:
            self.gpu_lost = dispatcher.fatal
            if self.recovery is not None:  # a crash of the serving phase, by its own word
                self.recovery.crashed(Phases.SERVING, dispatcher.fatal, EX_SOFTWARE)
            return EX_SOFTWARE
        save_learned(dispatcher.loaded, service.reloader.in_force)
        dispatcher.loaded.close()
        return service.reloader.fatal.exit_code if service.reloader.fatal else 0

    def _serving(self, loaded: Loaded, watch: Any) -> None:
        """READY=1 is sent: the service counts as serving; the warm-up's calibration after READY starts."""
        from edge.lifecycle.warmup.after_ready import start_after_ready

        if self.recovery is not None:
            self.recovery.serving(self.config)
        if self.report is not None:
            self.calibrating = start_after_ready(loaded, self.config, self.notifier, *self.report, watch)

    def _handed_over(self, handover: Any, loaded: Loaded) -> int:
        """After a handover: drained, the report's drain written, this set freed (learned prefix
        states are not saved: the new process restored them at its start already); 0, or 70
        when the restart that memory made of it failed (the unit restarts edge)."""
        if handover.successor_pid is None:
            log.error("the new process did not take over after this one freed its models: exiting %d",
                      EX_SOFTWARE)
            return EX_SOFTWARE
        self.handed_over_to = handover.successor_pid
        handover.finished()
        if handover.restart is None:
            loaded.close()
        return 0

    def _answer_given_up(self, given_up: GivenUp) -> int:
        """Safe mode is exhausted: no native path; every request answered at once with a 503
        naming why, until the give-up ends (edge.lifecycle.unavailable); then exit 0, and the
        next connection (or one waiting in the backlog) starts the service again."""
        from edge.lifecycle.unavailable import answer_given_up

        assert self.recovery is not None
        if self.takes_over:  # a new process of a handover does not take over to answer 503s
            self._ended_before_ready("failed", EX_SAFE_MODE_EXHAUSTED, str(given_up))
            return EX_SAFE_MODE_EXHAUSTED
        return answer_given_up(given_up, self.timer, self.recovery, self.notifier)

    async def _warm(self, loaded: Loaded) -> None:
        """The warm-up; a new process taking over warms up on a quarter of the cores, as a reload's
        new set does, beside the old process that serves on the rest (edge.lifecycle.handover.handover)."""
        if not self.takes_over:  # a start calibrates CPU models after READY (edge.lifecycle.warmup.after_ready)
            return await self.loader.warm(loaded, defer=True)
        workers = list(loaded.state.workers.values())
        await threads_of(workers, split_cores()[0])
        try:
            await self.loader.warm(loaded)
        finally:
            await threads_of(workers, None)

    def rehearse(self, recalibrate: bool = False) -> dict[str, Any]:
        """Everything a start does up to READY, with no socket and no report written: what a
        start would take (`edge warmup`; with `recalibrate`, the warm-up plan is measured and
        stored anew)."""
        self.notifier.enabled = False
        self.read_config()
        self.loader.auth = None  # no client is served: the key file is not read (it may be root's)
        self.loader.recalibrate = recalibrate
        loaded = self.loader.load()

        async def go() -> dict[str, Any]:
            if self.before_warm is not None:
                self.before_warm(loaded)
            await self.loader.warm(loaded)
            return self.timer.report(config=self.config.source, sockets=[], models=loaded.infos,
                                     warmup=loaded.warmup, calibration=loaded.plans, rehearsal=True)

        import asyncio

        try:
            return asyncio.run(go())
        finally:
            loaded.close()

    # -- the phases --------------------------------------------------------------------------------
    @property
    def loader(self) -> Loader:
        if self._loader is None:
            raise RuntimeError("read_config() first")
        return self._loader

    @property
    def config(self) -> Config:
        return self.loader.config

    @property
    def config_read(self) -> Config | None:
        """The config once the config phase has read it; None before (or when it failed)."""
        return self._loader.config if self._loader is not None else None

    def read_config(self) -> Config:
        """The config phase, then the recovery phase (safe mode decided: a start; only read: a
        rehearsal); this start's loader is made from what they give."""
        cfg = read_config(self.config_path, self.timer)
        mode = self.recovery.decide(cfg) if self.recovery else SafeMode.load(state_dir(cfg))
        self._loader = Loader(cfg, self.timer, self.notifier, safe_mode=mode, at_start=True)
        return self._loader.config

    def open_sockets(self) -> list[socket.socket]:
        """Inherited from systemd (LISTEN_FDS), else bound now from the [server] table; then who
        may use them (edge.serve.auth): a socket others can reach (as getsockname() shows) needs
        API keys or allow_unauthenticated, else the start ends here (78); and TLS, if set."""
        from edge.serve.auth import check_exposure, served_open
        from edge.serve.tls import tls_files

        with self.timer.phase(Phases.SOCKETS) as ph:
            self.sockets = listen_sockets()
            ph.detail["inherited"] = bool(self.sockets)
            if not self.sockets:  # (serving imports asyncio: only a start that binds its own pays it here)
                from edge.lifecycle.sockets import bind_sockets

                self.sockets = bind_sockets(self.config.server, self.config.source)
            server, keys = self.config.server, self.loader.auth
            self.exposed = check_exposure(self.sockets, keys, server, self.config.source)
            served_open(self.exposed, keys)  # the WARNING, if so
            self.tls = tls_files(server, self.config.source)
            ph.detail.update(api_keys=keys is not None, tls=self.tls is not None)
        return self.sockets

    def mark_ready(self, loaded: Loaded) -> str:
        """The moment traffic is handed over: the report is written, then READY=1 and the first
        accept() follow at once. Returns the READY status text."""
        from edge.lifecycle.sockets import describe_socket
        from edge.lifecycle.warmup.after_ready import describe

        if self.takeover is not None:  # its priority back, its models waiting for the old process's drain
            self.takeover.before_serving(list(loaded.state.workers.values()), self.config.server.drain_timeout_s)
        loaded.state.ready = True
        addresses = [describe_socket(s) for s in self.sockets]
        now = self.timer.now()
        self.timer.add(Phases.READY, now, now, sockets=len(addresses))
        if self.recovery is not None:
            self.recovery.journal.ready()  # before the report: a start is counted once, ok or crashed
        report = self.timer.report(config=self.config.source, sockets=addresses, models=loaded.infos,
                                   warmup=loaded.warmup, calibration=loaded.plans,
                                   journal=self.recovery.journal.cost() if self.recovery else None,
                                   **({"compiled": self.compiled.stop()} if self.compiled else {}),
                                   **(self.takeover.report() if self.takeover is not None else {}),
                                   **({"safe_mode": loaded.state.safe_mode} if loaded.state.safe_mode else {}))
        path: Path = write_report(report, state_dir(self.config))
        self.report = (report, path)  # rewritten when a calibration after READY ends
        loaded.state.metrics.set_phases(report["phases"])
        loaded.state.metrics.served_without_keys(self.exposed if loaded.state.auth is None else [], "start")
        loaded.state.metrics.track_fleet(state_dir(self.config))
        log.info("start report %s: ready in %.2f s", path, report["ready_s"],
                 extra={"START_REPORT": json.dumps(report), "READY_SECONDS": report["ready_s"]})
        safe = "; SAFE MODE: " + "; ".join(f"{s['target']}: {s['fallback']}" for s in loaded.state.safe_mode)
        return (f"ready: serving {', '.join(loaded.names)} on {', '.join(addresses)} "
                f"(start {report['ready_s']:.2f} s){safe if loaded.state.safe_mode else ''}{describe(loaded)}")

