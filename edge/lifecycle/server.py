"""uvicorn's Server on sockets someone else bound, as both of edge's servers run it: the service
(edge.lifecycle.serving) and the give-up's light process (edge.lifecycle.unavailable).

One subclass of uvicorn.Server for both (`uvicorn_server`): a signal goes to the caller's
`on_signal` (uvicorn's own handle_exit re-raises a captured SIGTERM after its graceful shutdown,
which would make a clean drain exit as "killed by signal"), and its startup sets `listening` once
the sockets are being accepted on. `serve_on` serves it: READY=1 then and not before, the watchdog
pinged from the event loop, and the caller's own tasks beside it. What this relies on of uvicorn
(`Server.startup(sockets)`, `started`, `should_exit`) is pinned in pyproject.toml.

uvicorn is imported when a server is made, not with this module: a start binds and checks its
sockets before the HTTP stack is imported.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from edge.lifecycle.systemd import Notifier, watchdog_interval_s

__all__ = ["serve_on", "uvicorn_server"]


def uvicorn_server(app: Any, on_signal: Callable[[Any], None], **options: Any) -> Any:
    """A loaded uvicorn server (protocol modules imported now, not at the first accept) for `app`,
    with h11 (edge's drain and connection guard read its protocol objects), no lifespan, no access
    log, edge's logging, and a 1 s graceful shutdown; `options`: the rest of uvicorn.Config."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.listening = asyncio.Event()

        def handle_exit(self, sig: int, frame: Any) -> None:
            on_signal(self)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                self.listening.set()

    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="off", access_log=False, log_config=None,
                            log_level="warning", **{"timeout_graceful_shutdown": 1, **options})
    config.load()
    return Server(config)


async def serve_on(sockets: list[socket.socket], server: Any, notifier: Notifier, ready: Callable[[], None],
                   beside: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
    """Serve `server` (made by uvicorn_server) on `sockets` until it exits. `ready()` runs once
    they are accepted on (it sends READY=1: a client is never told to come before accept() runs);
    then, until the server exits, the watchdog is pinged from this loop (a wedged loop stops the
    pings and systemd restarts the service) and each of `beside` runs as a task."""
    serving = asyncio.create_task(server.serve(sockets=sockets))
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({serving, listening}, return_when=asyncio.FIRST_COMPLETED)
    listening.cancel()
    if server.started:
        ready()
    tasks = [asyncio.create_task(run()) for run in beside]
    if watchdog_interval_s():
        tasks.append(asyncio.create_task(_watchdog(notifier)))
    try:
        await serving
    finally:
        for task in tasks:
            task.cancel()


async def _watchdog(notifier: Notifier) -> None:
    period = (watchdog_interval_s() or 0) / 4
    while True:
        notifier.watchdog()
        await asyncio.sleep(period)
