"""LoRA adapters across a load and a reload (issue 55; edge.model.adapters).

A model's adapters are not the model (`loadset.model_key` leaves them out): a reload that changes
only them keeps the loaded model (the same mapping, no page-in, no cold context) and loads the new
adapter files on its weights, on its worker thread between two steps (`load_kept`). The new set
serves its own adapter map (`ServiceState.adapters`), the old one keeps its until it has drained;
then the handles no set serves are freed (`Loaded.close(keep)` → `AdapterPool.prune`). Before a
set serves, each adapter is warmed by a short generation through its model's worker (`warm`),
as a client request would run it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from edge.config import Config

if TYPE_CHECKING:
    from edge.lifecycle.loadset import LoadPlan
    from edge.serve.state import ServiceState

__all__ = ["load_kept", "warm"]

WARM_PROMPT = "Hello"
WARM_TOKENS = 2


def load_kept(cfg: Config, plan: LoadPlan) -> dict[str, dict[str, Any]]:
    """Each kept model's adapters as the new config has them: loaded on its thread (files it
    has loaded already are taken from its pool). ModelError (exit 65 at a start; a failed
    reload, the old set serving on) for a damaged or mismatched file."""
    out = {}
    for i, m in enumerate(cfg.models):
        worker = plan.kept.get(m.name)
        if worker is None or not hasattr(worker, "model"):
            continue
        model = worker.model
        out[m.name] = worker.run(model.lora.load, m.adapters, model.info, f"models[{i}]")
    return out


async def warm(state: ServiceState) -> list[dict[str, Any]]:
    """Every adapter of the set: a short greedy generation with it through its model's worker
    (the same scheduler a request goes through, beside the requests a kept model serves). A
    failure fails the set's warm-up like any warm-up request's."""
    from edge.model.generate import GenParams, Job

    steps = []
    for name, worker in state.workers.items():
        for adapter in state.adapters_of(worker).values():
            t0 = time.perf_counter()
            tokens = await worker.control(worker.model.tokenize_prompt, WARM_PROMPT)
            job = Job(tokens=tokens, params=GenParams(max_tokens=WARM_TOKENS, temperature=0),
                      cache_prompt=False, remember=False, adapters=((adapter, adapter.scale or 1.0),))
            async for _ in worker.stream(job, admitted=True, eager=False):
                pass
            steps.append({"name": f"adapter {adapter.name}", "path": "(the model's worker)", "model": name,
                          "status": 200, "seconds": round(time.perf_counter() - t0, 4),
                          "prompt_tokens": len(tokens), "completion_tokens": job.completion_tokens})
    return steps
