"""systemd integration through systemd-python: inherited sockets, sd_notify, journal logging.

Outside systemd every call here is a no-op that returns False, so the same serving code runs
under systemd, under the test harness (which speaks the same protocol) and from a shell.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

__all__ = ["DRAINED_ENV", "HANDOVER_ENV", "listen_sockets", "Notifier", "setup_logging", "watchdog_interval_s"]

# Beside LISTEN_FDS: the pipe a handover's new process says "ready" on (edge.lifecycle.handover.handover)
HANDOVER_ENV = "EDGE_HANDOVER_FD"
# ...and the pipe whose end (EOF) tells it the old process has drained: its models may decode
DRAINED_ENV = "EDGE_HANDOVER_DRAINED_FD"

log = logging.getLogger("edge")


def listen_sockets() -> list[socket.socket]:
    """Sockets handed over by socket activation (LISTEN_FDS/LISTEN_PID), in fd order."""
    from systemd import daemon

    fds = daemon.listen_fds(unset_environment=True)
    return [socket.socket(fileno=fd) for fd in fds]


def watchdog_interval_s() -> float | None:
    """The watchdog period systemd expects pings within, or None when no watchdog is armed."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6
    except ValueError:
        return None


class Notifier:
    """sd_notify messages; `extend_while()` keeps extending the start timeout during long phases."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._extender: tuple[threading.Event, threading.Thread] | None = None

    def send(self, message: str) -> bool:
        if not self.enabled:
            return False
        from systemd import daemon

        return bool(daemon.notify(message))

    def status(self, text: str) -> bool:
        log.info("%s", text)
        return self.send(f"STATUS={text}")

    def reloading(self, text: str) -> bool:
        """RELOADING=1 with the monotonic clock systemd asks for (Type=notify-reload) and `text`."""
        log.info("%s", text)
        mono_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(f"RELOADING=1\nMONOTONIC_USEC={mono_usec}\nSTATUS={text}")

    def ready(self, text: str) -> bool:
        self.stop_extending()
        log.info("%s", text)
        return self.send(f"READY=1\nSTATUS={text}\nMAINPID={os.getpid()}")

    def stopping(self, text: str = "draining in-flight requests") -> bool:
        log.info("stopping: %s", text)
        return self.send(f"STOPPING=1\nSTATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_while(self, period_s: float = 10.0) -> None:
        """Until stop_extending(), ask systemd every period for 3 more periods of start time."""
        if not self.enabled or self._extender is not None:
            return
        stop = threading.Event()
        usec = int(period_s * 3 * 1e6)

        def loop() -> None:
            while True:
                self.send(f"EXTEND_TIMEOUT_USEC={usec}")
                if stop.wait(period_s):
                    return

        thread = threading.Thread(target=loop, name="edge-extend-timeout", daemon=True)
        self._extender = (stop, thread)
        thread.start()

    def stop_extending(self) -> None:
        """Stop, and wait for the extender: no EXTEND_TIMEOUT_USEC can follow READY=1."""
        if self._extender is not None:
            stop, thread = self._extender
            self._extender = None
            stop.set()
            if thread is not threading.current_thread():
                thread.join()


def _stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(level: str = "info") -> None:
    """Log to the journal (structured) when systemd connected stderr to it, else to stderr."""
    handler: logging.Handler
    if _stderr_is_journal():
        from systemd.journal import JournalHandler

        handler = JournalHandler(SYSLOG_IDENTIFIER="edge")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s edge[%(process)d] %(levelname)s %(message)s"))
    for name, lvl in (("edge", level.upper()), ("uvicorn", "WARNING")):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(lvl)
        logger.propagate = False
