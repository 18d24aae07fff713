"""What the lifecycle shares, below start, reload and serving: the loaded set (`Loaded`: the app,
its workers and engines, what was loaded and warmed), the plan of a load (`LoadPlan`: files to
load, engines to load, workers to take over) and what makes a model the same one (`model_key`).

The data of a start flows one way (DESIGN.md): config → `LoadPlan` → `Loaded` → serving. The
plan and the set are made by `edge.lifecycle.loader.Loader`; `edge.lifecycle.serving` routes requests to a `Loaded`,
`edge.lifecycle.reload` switches from one to the next. This module imports none of them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge.config import Config, EngineConfig, ModelConfig
from edge.fsutil import file_identity

if TYPE_CHECKING:
    import concurrent.futures

    from edge.serve.app import ServiceState
    from edge.serve.worker import ModelWorker, Worker
    from edge.model.gguf import GGUFInfo
    from edge.model.file import ModelFile

    Validation = concurrent.futures.Future[tuple[float, float, GGUFInfo]]

__all__ = ["Loaded", "LoadPlan", "close_worker", "model_key", "save_learned", "set_threads", "split_cores",
           "threads_of"]


@dataclass
class Loaded:
    """One loaded and (after `Loader.warm`) warmed set: what serves, and what it is."""

    app: Any  # the Starlette app built over `state`
    state: ServiceState
    infos: list[dict[str, Any]]
    warmup: list[dict[str, Any]] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)  # per model/engine: plan, candidates
    keys: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # name -> what makes it the same
    kept: list[str] = field(default_factory=list)  # workers taken over from the previous set
    closed: set[str] = field(default_factory=set)
    later: list[Any] = field(default_factory=list)  # calibrations left for after READY (warmplan.Later)

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
            if id(worker) in shared:  # kept by `keep`: only the adapters it does not serve are freed
                if keep is not None and hasattr(worker, "model"):
                    worker.run(worker.model.lora.prune, [keep.state.adapters_of(worker)])
                continue
            if name not in self.closed:
                close_worker(worker)
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
    validations: list[Validation] = field(default_factory=list)  # one per file, joined by the load
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)  # kept models' adapters as the new set serves them


def close_worker(worker: Worker) -> None:
    """A model's or engine's worker, and what it holds, closed now (not whenever GC gets to it)."""
    from edge.serve.worker import ModelWorker  # imported with the set this worker belongs to

    worker.close()  # waits for the job on its thread, if any
    if isinstance(worker, ModelWorker):
        worker.model.close()  # the llama.cpp context, the prompt cache and the mapping


def model_key(m: ModelConfig) -> tuple[Any, ...]:
    """A model is the same one when its resolved file (same inode, size and mtime) and every
    setting that shapes the loaded model are; page-in settings do not, and neither does the path
    when the file is known by its identity: OTA versions hard-link one file from their content
    store under each version's own path, and a config-only update keeps the loaded model."""
    try:
        ident = file_identity(m.path)
    except OSError:
        ident = ()
    # adapters are not the model: a reload that changes only them keeps it (edge.lifecycle.adapters)
    same = dataclasses.replace(m, path="" if ident else m.path, prefetch=True, prefetch_threads=1, adapters=[])
    return ("model", same, ident)


def split_cores() -> tuple[int, int]:
    """While a new set warms up beside a serving one: (its threads, the serving ones'): a quarter
    of the cores (at least one) and the rest. ggml's threads spin at their barriers, so two full
    thread pools on the same few cores slow serving far more than their share."""
    cores = os.cpu_count() or 1
    warm = max(1, cores // 4)
    return warm, max(1, cores - warm)


def set_threads(model: Any, n: int | None) -> None:
    """On the model's worker thread: at most n threads for decode and batch, or (None) its own."""
    s = model.native.settings
    model.native.set_threads(n or s.n_threads, n or s.n_threads_batch)


async def threads_of(workers: list[ModelWorker], n: int | None) -> None:
    """Every model worker's thread count set (None: back to its own), each on its own thread,
    queued behind the requests it is running."""
    import asyncio

    await asyncio.gather(*(w.control(set_threads, w.model, n) for w in workers),
                         return_exceptions=True)


def save_learned(loaded: Loaded, cfg: Config) -> None:
    """At SIGTERM, after the drain: each model's prefixes that traffic reused most, for the next
    start (models with `learn_prefixes`)."""
    import logging

    from edge.config import cache_dir
    from edge.model.prefixstore import folder_for, save_learned as save

    log = logging.getLogger("edge")
    for name, w in loaded.state.workers.items():
        if w.model.cfg.learn_prefixes and name not in loaded.closed:
            try:
                rows = w.run(save, w.model, folder_for(cache_dir(cfg), name))
            except OSError as exc:  # a full or read-only disk: the next start has none, no more
                log.warning("%s: learned prefixes not saved: %s", name, exc)
                continue
            log.info("%s: learned prefixes saved for the next start: %d (%s)", name, len(rows),
                     ", ".join(f"{r['tokens']} tokens, {r['hits']} hits" for r in rows) or "none")
