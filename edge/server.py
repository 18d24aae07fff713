"""The resident service: page-in, load, lock, warm up, then READY=1 and accept on the sockets.

`serve()` takes a finished config and sockets that are already listening (inherited from
systemd or bound by the CLI), so connections made at any point of the start wait in the
kernel's backlog and are accepted only once warm-up is done.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

from edge.config import Config, ServerConfig, cache_dir, state_dir
from edge.errors import MlockError
from edge.systemd import Notifier, watchdog_interval_s
from edge.timing import StartTimer, write_report

__all__ = ["StoppedDuringStart", "bind_sockets", "describe_socket", "rehearse", "serve"]

log = logging.getLogger("edge")

# After SIGTERM: how long accepted connections get to have their request read (at least, at most).
ACCEPT_GRACE_MIN_S = 0.1
ACCEPT_GRACE_MAX_S = 5.0


def bind_sockets(cfg: ServerConfig) -> list[socket.socket]:
    """Listening sockets from the [server] table: a Unix socket if set, else host:port."""
    if cfg.unix_socket:
        path = Path(cfg.unix_socket)
        if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
            path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, int(cfg.unix_socket_mode, 8))
    else:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
    sock.listen(cfg.backlog)
    return [sock]


def describe_socket(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name}"
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


def serve(cfg: Config, sockets: list[socket.socket], timer: StartTimer,
          notifier: Notifier | None = None) -> int:
    """Start, warm up, serve until SIGTERM/SIGINT, drain; return the exit code (0)."""
    notifier = notifier or Notifier()
    signal.signal(signal.SIGTERM, _stop_during_start)
    notifier.extend_while()
    app, state, infos = _prepare(cfg, timer, notifier)
    addresses = [describe_socket(s) for s in sockets]
    import asyncio

    return asyncio.run(_run(app, state, cfg, sockets, notifier, timer, infos, addresses, state_dir(cfg)))


def rehearse(cfg: Config, timer: StartTimer) -> dict[str, Any]:
    """Everything a start does up to READY, with no socket and no report written: the report of
    what a start would take (`edge warmup`, for tuning the warm-up plan on the device)."""
    notifier = Notifier()
    notifier.enabled = False
    app, state, infos = _prepare(cfg, timer, notifier)
    import asyncio

    async def go() -> dict[str, Any]:
        warm = await _warm_up(app, state, cfg, notifier, timer)
        return timer.report(config=cfg.source, sockets=[], models=infos, warmup=warm, rehearsal=True)

    try:
        return asyncio.run(go())
    finally:
        for worker in [*state.workers.values(), *state.engines.values()]:
            worker.close()


def _prepare(cfg: Config, timer: StartTimer, notifier: Notifier) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Page-in, imports, model and engine loads: the app, its state, and what was loaded."""
    from edge.models import VerifiedCache, resolve_model

    verified = VerifiedCache(cache_dir(cfg) / "verified.json")
    with timer.phase("resolve_models"):
        models = [resolve_model(m, cache_dir(cfg), verified) for m in cfg.models]
    pageins = _start_pageins(models, verified, timer)
    with timer.phase("imports") as ph:  # beside the page-in threads
        notifier.status("importing the inference backends")
        ph.detail["modules"] = _import_modules((["llama_cpp"] if cfg.models else []) + (
            ["onnxruntime"] if any(e.backend == "onnxruntime" for e in cfg.engines) else []))
    _finish_pageins(pageins, models, verified, timer)
    import concurrent.futures

    # llama.cpp loads with the GIL released: the HTTP stack is imported meanwhile.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-load") as pool:
        loading = pool.submit(_load_models, models, {n: i for n, (_, i) in pageins.items()}, cfg,
                              notifier, timer)
        with timer.phase("imports_http") as ph:
            ph.detail["modules"] = _import_modules(["uvicorn", "starlette.applications", "edge.app"])
        workers, infos = loading.result()
    from edge.app import ServiceState, build_app
    from edge.engines.serve import load_engines

    state = ServiceState(workers=workers)
    state.engines, engine_infos = load_engines(cfg, timer)
    return build_app(state), state, infos + engine_infos


def _import_modules(names: list[str]) -> list[str]:
    import importlib

    for name in names:
        importlib.import_module(name)
    return names


def _start_pageins(models: list[Any], verified: Any, timer: StartTimer) -> dict[str, Any]:
    from edge.gguf import read_gguf_info
    from edge.pagein import PageIn

    pageins = {}
    for m in models:
        # Reading starts before validation so that validation itself reads from warm pages;
        # a file that fails validation only cost some reads.
        need_hash = bool(m.sha256) and os.path.isfile(m.path) and \
            not verified.is_verified(Path(m.path), m.sha256)
        threads = m.prefetch_threads if m.prefetch else 0
        pagein = None
        if (threads or need_hash) and os.path.isfile(m.path):
            pagein = PageIn(m.path, threads=threads, hash_sha256=need_hash).start()
        with timer.phase("validate", model=m.name) as ph:
            info = read_gguf_info(m.path)
            ph.bytes = info.size
            ph.detail.update(info.summary())
        pageins[m.name] = (pagein, info)
    return pageins


def _finish_pageins(pageins: dict[str, Any], models: list[Any], verified: Any, timer: StartTimer) -> None:
    from edge.errors import ModelError

    mono0 = time.monotonic() - timer.now()
    for m in models:
        pagein, _ = pageins[m.name]
        if pagein is None:
            continue
        res = pagein.result()
        timer.add("page_in", res.start_s - mono0, res.end_s - mono0, nbytes=res.bytes,
                  model=m.name, threads=pagein.threads, **res.as_detail())
        if res.sha256 is not None:
            if res.sha256 != m.sha256.lower():
                raise ModelError(m.path, f"sha256 mismatch: expected {m.sha256}, found {res.sha256}")
            verified.remember(Path(m.path), res.sha256)


def _load_models(models: list[Any], gguf_infos: dict[str, Any], cfg: Config, notifier: Notifier,
                 timer: StartTimer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from edge.llm import ModelWorker, load_gguf_model

    workers, infos = {}, []
    for m in models:
        notifier.status(f"loading {m.name} ({m.path})")
        with timer.phase("model_load", model=m.name, use_mmap=m.use_mmap, use_mlock=m.use_mlock) as ph:
            model = load_gguf_model(m, gguf_infos[m.name])
            ph.bytes = model.info.size
        with timer.phase("mlock_verify", model=m.name) as ph:
            ph.detail.update(model.mlock.as_dict())
            if not model.mlock.ok:
                if m.require_mlock:
                    raise MlockError(f"{m.name}: {model.mlock.explain()}")
                log.warning("%s: %s", m.name, model.mlock.explain())
        workers[m.name] = ModelWorker(model, cfg.server.max_queue)
        infos.append({"name": m.name, "path": m.path, "n_ctx": model.n_ctx,
                      "mlock": model.mlock.as_dict(), **model.info.summary()})
    return workers, infos


async def _warm_up(app: Any, state: Any, cfg: Config, notifier: Notifier,
                   timer: StartTimer) -> list[dict[str, Any]]:
    from edge.warmup import LoopbackHTTP, engine_plan, plan_for, run_warmup

    warm: list[dict[str, Any]] = []
    async with LoopbackHTTP(app) as http:
        if cfg.warmup.enabled:
            for name, worker in state.workers.items():
                notifier.status(f"warming up {name}")
                with timer.phase("warmup", model=name) as ph:
                    steps = await worker.call(plan_for, worker.model, cfg.warmup)
                    ph.detail["steps"] = await run_warmup(http, steps)
                    warm += ph.detail["steps"]
        for name, eng in state.engines.items():
            if next(e for e in cfg.engines if e.name == name).warmup:
                notifier.status(f"warming up engine {name}")
                with timer.phase("warmup", engine=name) as ph:
                    ph.detail["steps"] = await run_warmup(http, engine_plan(name, eng.session))
                    warm += ph.detail["steps"]
    return warm


async def _run(app: Any, state: Any, cfg: Config, sockets: list[socket.socket], notifier: Notifier,
               timer: StartTimer, infos: list[dict[str, Any]], addresses: list[str], state_path: Path) -> int:
    warm = await _warm_up(app, state, cfg, notifier, timer)
    with timer.phase("http_setup"):
        server = _http_server(app, state, cfg, notifier)
        gc.collect()
        gc.freeze()  # warm-up garbage is gone; what lives now is never scanned again
    state.ready = True
    # "ready" marks the moment traffic is handed over: the report is written, READY=1 sent and
    # the first accept() made right after it.
    now = timer.now()
    timer.add("ready", now, now, sockets=len(addresses))
    report = timer.report(config=cfg.source, sockets=addresses, models=infos, warmup=warm)
    path = write_report(report, state_path)
    state.metrics.set_phases(report["phases"])
    log.info("start report %s: ready in %.2f s", path, report["ready_s"],
             extra={"START_REPORT": json.dumps(report), "READY_SECONDS": report["ready_s"]})
    ready_text = (f"ready: serving {', '.join([*state.workers, *state.engines])} on "
                  f"{', '.join(addresses)} (start {report['ready_s']:.2f} s)")
    await _serve_http(server, sockets, notifier, ready_text)
    for worker in [*state.workers.values(), *state.engines.values()]:
        worker.close()
    return 0


def _http_server(app: Any, state: Any, cfg: Config, notifier: Notifier) -> Any:
    """The uvicorn server, loaded (protocol modules imported) before READY, not on first accept."""
    import asyncio

    import uvicorn

    loop = asyncio.get_running_loop()

    class Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would make a
        # clean drain exit as "killed by signal"; edge drains and then exits 0 instead.
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit or state.stopping:
                self.force_exit = True  # a second signal: stop waiting for in-flight requests
                self.should_exit = True
                return
            state.stopping = True
            notifier.stopping()
            loop.call_soon_threadsafe(self._stop_accepting)

        def _stop_accepting(self) -> None:
            # Stop accepting, then wait until every connection already accepted has had its
            # request read, and only then let uvicorn shut down; what is still in the backlog
            # stays there for the next process. Two races make clients see resets otherwise:
            # uvicorn's shutdown closes connections that have no request yet, and asyncio's
            # Server.close() drops (unclosed, later reset) connections whose accept() ran but
            # whose transport was not made yet. So accepting stops by removing the listening
            # sockets' readers, and the Server is closed later by uvicorn.
            for srv in getattr(self, "servers", []):
                for sock in srv.sockets:
                    loop.remove_reader(sock.fileno())
            deadline = loop.time() + ACCEPT_GRACE_MAX_S
            loop.call_later(ACCEPT_GRACE_MIN_S, self._exit_when_no_request_pending, deadline)

        def _exit_when_no_request_pending(self, deadline: float) -> None:
            waiting = [c for c in self.server_state.connections if getattr(c, "cycle", 1) is None]
            if not waiting or loop.time() >= deadline:
                self.should_exit = True
            else:
                loop.call_later(0.05, self._exit_when_no_request_pending, deadline)

    config = uvicorn.Config(app, loop="asyncio", lifespan="off", access_log=False, log_config=None,
                            log_level="warning", timeout_keep_alive=5,
                            timeout_graceful_shutdown=int(cfg.server.drain_timeout_s) or None)
    config.load()
    return Server(config)


async def _serve_http(server: Any, sockets: list[socket.socket], notifier: Notifier, ready_text: str) -> None:
    import asyncio

    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.001)  # READY=1 once the sockets are being accepted on, not before
    if server.started:
        notifier.ready(ready_text)
    watchdog = asyncio.create_task(_watchdog(notifier)) if watchdog_interval_s() else None
    try:
        await serving
    finally:
        if watchdog:
            watchdog.cancel()


async def _watchdog(notifier: Notifier) -> None:
    import asyncio

    # Pinged from the event loop itself: a wedged loop stops the pings and systemd restarts us.
    period = (watchdog_interval_s() or 0) / 4
    while True:
        notifier.watchdog()
        await asyncio.sleep(period)


class StoppedDuringStart(Exception):
    """SIGTERM arrived before the service was ready: nothing was accepted, so exit cleanly."""


def _stop_during_start(sig: int, frame: Any) -> None:
    raise StoppedDuringStart()
