"""What one served set is while it serves: its workers and engines, its metrics, whether it is
ready, what safe mode left out, the keys a request needs, and how it ends when it can serve no
more. The HTTP app (edge.serve.app) is built from one; the lifecycle fills it and flips it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.errors import RequestError
from edge.serve.metrics import Metrics

if TYPE_CHECKING:
    from edge.serve.auth import ApiKeys
    from edge.serve.worker import ModelWorker

__all__ = ["ServiceState"]


@dataclass
class ServiceState:
    workers: dict[str, ModelWorker]
    engines: dict[str, Any] = field(default_factory=dict)  # name -> EngineWorker
    metrics: Metrics = field(default_factory=Metrics)
    ready: bool = False
    stopping: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # safe mode (edge.lifecycle.safemode): engines left out (name -> why: their routes answer 503)
    # and every fallback in force, as the start report, `edge status` and /metrics show them
    left_out: dict[str, str] = field(default_factory=dict)
    safe_mode: list[dict[str, Any]] = field(default_factory=list)
    fatal_reason: str | None = None  # why this set can serve no more (a lost CUDA context): the exit's cause
    on_fatal: Callable[[str], None] | None = None  # the lifecycle's: stop accepting, STOPPING=1, exit 70
    auth: ApiKeys | None = None  # the keys a request needs (edge.serve.auth, checked by the server); None: none
    # each model's LoRA adapters as this set serves them (edge.model.adapters): a reload that keeps
    # a model and changes its adapters gives the new set its own, the old set keeps its until drained
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)

    def fatal(self, reason: str) -> None:
        """This set can do no more work and the process must go (a sticky CUDA error lost the
        context its engines and offloaded layers share): not ready from now on, and the lifecycle
        stops the service, which exits 70 for the unit to restart. Once; later calls are no-ops.
        The one place a service's fatal end is decided: what records it hooks here."""
        if self.fatal_reason is not None:
            return
        self.fatal_reason, self.ready = reason, False
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def readiness(self) -> tuple[int, dict[str, str]]:
        """/readyz's answer: 200 when serving; 503 while starting, stopping, or after fatal()."""
        if self.fatal_reason:
            return 503, {"status": "failed", "reason": self.fatal_reason}
        if self.ready and not self.stopping:
            return 200, {"status": "ready"}
        return 503, {"status": "stopping" if self.stopping else "starting"}

    def leaving(self) -> RequestError:
        """What a request gets once fatal() was called: 503 with Retry-After (the next process
        answers), naming why."""
        return RequestError(f"the service is restarting: {self.fatal_reason}", status=503, code="service_unavailable")

    def adapters_of(self, worker: ModelWorker) -> dict[str, Any]:
        return self.adapters.get(worker.name, worker.model.adapters)

    def pick(self, name: Any) -> tuple[ModelWorker, str | None]:
        """The model a request names, and the adapter after its colon (`base:adapter`; a model
        whose own name has a colon is found first)."""
        if isinstance(name, str) and name not in self.workers and ":" in name:
            base, adapter = name.rsplit(":", 1)
            if base in self.workers:
                return self.workers[base], adapter
        return self.worker(name), None

    def worker(self, name: Any) -> ModelWorker:
        if not self.workers:
            raise RequestError("no language model is served here (only engines: use /v2/models)",
                               status=404, param="model", code="model_not_found")
        if name is None:
            return next(iter(self.workers.values()))
        if not isinstance(name, str) or name not in self.workers:
            raise RequestError(f"model {name!r} is not served here; models: {sorted(self.workers)}",
                               status=404, param="model", code="model_not_found")
        return self.workers[name]
