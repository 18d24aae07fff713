"""`edge serve`'s start, without typer: what the unit runs (edge.cli.main dispatches it before the
typer app is imported) and what the typer command calls."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.bytecode import CompileWatch

__all__ = ["serve"]


def serve(config: str | None, watch: CompileWatch | None = None) -> int:
    """Load, lock and warm up the models, then serve on the inherited or configured socket; the
    exit code. `watch`: the source files compiled since exec, for the start report (made by
    edge.cli.main before anything else; None: the report leaves them out)."""
    from edge.timing import StartTimer

    timer = StartTimer()  # first: the report measures from exec, config parsing included
    import faulthandler

    # a native fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) writes every thread's Python stack to
    # stderr, which is the journal under systemd, and then dies by the signal as before
    faulthandler.enable(all_threads=True)
    from edge.lifecycle.systemd import HANDOVER_ENV

    takeover = None
    if os.environ.get(HANDOVER_ENV):  # started by a running edge to take over from it
        from edge.lifecycle.handover.priority import yield_cpu

        yielded = yield_cpu()  # below the serving process's CPU priority until ready, imports included
        from edge.lifecycle.handover.successor import Takeover

        takeover = Takeover.from_env(yielded)
    from edge.lifecycle.start import ColdStart

    start = ColdStart(config, timer=timer, takeover=takeover, compiled=watch)
    code = start.run()  # however it ends, its journal and reports say so (edge.lifecycle.recovery)
    if start.gpu_lost:  # not even the finalizers at exit may touch the lost CUDA context
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Exit without running finalizers (llama.cpp's frees would be CUDA calls on a lost context,
    which ggml answers with abort()); the logs are flushed first."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
