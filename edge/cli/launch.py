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

    _ota_at_start(config)
    start = ColdStart(config, timer=timer, takeover=takeover, compiled=watch)
    code = start.run()  # however it ends, its journal and reports say so (edge.lifecycle.recovery)
    if start.gpu_lost:  # not even the finalizers at exit may touch the lost CUDA context
        _exit_now(code)
    return code


def _ota_at_start(config: str | None) -> None:
    """The service serves an OTA version (`--config <state_dir>/ota/current/edge.toml`): before its
    config is read, an interrupted repair of that version is finished and the version checked as a
    boot checks it (edge.ota.repair), so a start never serves what a repair left half-done.
    Nothing for any other config; never a reason for the start to fail (a state the service may
    not write, under the unit's sandbox, is said and left to `edge ota recover --boot`)."""
    if config is None or os.path.abspath(config).split(os.sep)[-3:] != ["ota", "current", "edge.toml"]:
        return
    import json
    import logging
    from pathlib import Path

    from edge.config import load_config
    from edge.errors import EdgeError
    from edge.ota.install import Ota

    log = logging.getLogger("edge")
    try:
        cfg = load_config(Path(config))
        key = Path(cfg.ota.pubkey)
        ota = Ota(Path(os.path.abspath(config)).parents[1], keep=cfg.ota.keep_versions,
                  pubkey=key if key.is_file() else None)
        done = ota.at_start()
    except (OSError, EdgeError) as exc:
        log.warning("the OTA check of the served version before this start was not made: %s", exc)
        return
    except Exception:  # an OTA bug must not keep the service from starting: said once, with its stack
        log.exception("the OTA check of the served version before this start failed")
        return
    if done is not None:
        log.warning("OTA, before this start: %s", json.dumps(done))


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
