"""The per-model and per-engine families of `/metrics`, read from the served set at each scrape
(edge.serve.metrics's collector): prompt caches, engines' dynamic batching, the slots' steps and
suspensions, speculative decoding."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from edge.serve.worker import EngineWorker, ModelWorker

__all__ = ["batch_families", "prompt_cache_families", "slot_families", "speculative_families"]


def prompt_cache_families(workers: dict[str, ModelWorker]) -> Iterator[Metric]:
    """Each model's prompt cache (edge.model.promptcache), read at the scrape: bytes held and allowed,
    requests that reused a cached prefix or not, prompt tokens reused."""
    caches = {n: w.model.cache for n, w in workers.items()}
    held = GaugeMetricFamily("edge_prompt_cache_bytes", "KV state bytes the prompt cache holds in host "
                             "memory (saved prefixes, pinned ones included).", labels=["model"])
    limit = GaugeMetricFamily("edge_prompt_cache_limit_bytes", "The prompt cache's bound "
                              "(models[].prompt_cache_mb).", labels=["model"])
    hits = CounterMetricFamily("edge_prompt_cache_hits", "Requests whose prompt reused a cached "
                               "prefix of at least 16 tokens (live or saved).", labels=["model"])
    misses = CounterMetricFamily("edge_prompt_cache_misses", "Requests whose prompt reused no "
                                 "cached prefix (fewer than 16 tokens).", labels=["model"])
    reused = CounterMetricFamily("edge_prompt_cache_reused_tokens", "Prompt tokens whose KV was "
                                 "reused instead of computed.", labels=["model"])
    for name, cache in caches.items():
        held.add_metric([name], float(cache.nbytes))
        limit.add_metric([name], float(cache.limit_bytes))
        hits.add_metric([name], float(cache.stats.hits))
        misses.add_metric([name], float(cache.stats.misses))
        reused.add_metric([name], float(cache.stats.reused_tokens))
    yield from (held, limit, hits, misses, reused)


def batch_families(engines: dict[str, EngineWorker]) -> Iterator[Metric]:
    """Each batching engine's batches (edge.engines.dynamic_batching), read at the scrape: requests per
    execution, and each request's wait for its batch (warm-up excluded)."""
    size = HistogramMetricFamily("edge_engine_batch_size", "Requests per execution of an engine that "
                                 "batches ([engines.batching]).", labels=["engine"])
    delay = HistogramMetricFamily("edge_engine_queue_delay_seconds", "Time from a request's arrival at "
                                  "an engine's batcher to the start of its batch's execution.",
                                  labels=["engine"])
    for name, worker in engines.items():
        if worker.batcher is None:  # one request at a time
            continue
        stats = worker.batcher.stats
        with stats.lock:
            size.add_metric([name], stats.batch_size.cumulative(), stats.batch_size.sum)
            delay.add_metric([name], stats.queue_delay.cumulative(), stats.queue_delay.sum)
    yield from (size, delay)


def slot_families(workers: dict[str, ModelWorker]) -> Iterator[Metric]:
    """Each model's slots (edge.model.slots), read at the scrape: how many, how many busy, the
    steps and what they held (tokens and sequences per step: the rates' ratio), the time
    generations waited for a slot."""
    gauges = {"slots": GaugeMetricFamily("edge_slots", "Sequences a model decodes at once "
                                         "(models[].parallel).", labels=["model"]),
              "busy": GaugeMetricFamily("edge_slots_busy", "Slots generating or prefilling now.", labels=["model"])}
    counters = {k: CounterMetricFamily(f"edge_batch_{k}", help_, labels=["model"]) for k, help_ in (
        ("steps", "llama_decode steps of a model's slots (one batch each)."),
        ("tokens", "Tokens decoded in those steps (over steps: the batch size per step)."),
        ("sequences", "Sequences in those steps, summed (over steps: sequences per step)."),
        ("suspended", "Sequences that gave their cells up while they ran (the context outgrown), "
                      "resumed once room came back."))}
    seconds = {k: CounterMetricFamily(f"edge_batch_{k}_seconds", help_, labels=["model"]) for k, help_ in (
        ("step", "Time in the steps of a model's slots: llama_decode, sampling, building the batch, admission."),
        ("decode", "Of that, time in llama_decode."),
        ("sample", "Of that, time sampling and making text after the decodes."))}
    wait = CounterMetricFamily("edge_queue_wait_seconds", "Time generations waited for a free slot, "
                               "summed (over edge_queue_started: the mean wait).", labels=["model"])
    started = CounterMetricFamily("edge_queue_started", "Generations that left the queue for a slot.",
                                  labels=["model"])
    for name, w in workers.items():
        slots = w.model.slots
        gauges["slots"].add_metric([name], float(slots.n))
        gauges["busy"].add_metric([name], float(slots.busy))
        st = slots.stats
        for k, v in (("steps", st.steps), ("tokens", st.batch_tokens), ("sequences", st.batch_sequences),
                     ("suspended", st.suspended)):
            counters[k].add_metric([name], float(v))
        for k, v in (("step", st.step_s), ("decode", st.decode_s), ("sample", st.sample_s)):
            seconds[k].add_metric([name], float(v))
        wait.add_metric([name], float(w.queue_wait_s))
        started.add_metric([name], float(w.started))
    yield from (*gauges.values(), *counters.values(), *seconds.values(), wait, started)


def speculative_families(workers: dict[str, ModelWorker]) -> Iterator[Metric]:
    """Each model's speculative decoding (edge.model.speculate): tokens proposed, tokens the
    target took, and their ratio since the start."""
    counters = {k: CounterMetricFamily(f"edge_speculative_{k}", help_, labels=["model"]) for k, help_ in (
        ("drafted_tokens", "Tokens proposed from a sequence's own context and verified in a step."),
        ("accepted_tokens", "Of those, the tokens the model's sampling picked too (each saved a step)."),
        ("verify_steps", "Sequence-steps that verified at least one proposal."),
        ("paused", "Times a sequence stopped proposing, its acceptance under models[].speculative.min_acceptance."))}
    rate = GaugeMetricFamily("edge_speculative_acceptance_ratio", "Accepted over drafted tokens since the "
                             "start (0 before any proposal).", labels=["model"])
    for name, w in workers.items():
        st = w.model.slots.spec_stats
        for k, v in (("drafted_tokens", st.drafted), ("accepted_tokens", st.accepted),
                     ("verify_steps", st.steps), ("paused", st.paused)):
            counters[k].add_metric([name], float(v))
        rate.add_metric([name], st.accepted / st.drafted if st.drafted else 0.0)
    yield from (*counters.values(), rate)
