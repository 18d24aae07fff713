"""Prometheus metrics through prometheus_client: one registry per app, an ASGI middleware that
times every request to the end of its body, and the start report's phases.

Labels are bounded: requests are labelled by the route TEMPLATE that matched
(`/v2/models/{name}/infer`), never the raw path, with `<unmatched>` for anything else, and by a
known method or `OTHER`. The exposition is written by `generate_latest`, which escapes label
values, so no request can make it unparseable.

Warm-up traffic is recognised by a key in the ASGI scope that only the warm-up's private
transport (edge.serve.warmscope's `warmup_transport`, over a socket pair of the process: no
listener) sets. A scope key is not something an HTTP client can send: no header, path or body
reaches it, so an external client cannot pass its traffic off as warm-up to hide it. Warm-up
requests are counted apart (`edge_warmup_requests_total`) and kept
out of every production family; the per-model families (tokens, time to first token, aborts) are
recorded in the handler, so the middleware tells them through a context variable, which each
request's task (and the tasks it spawns) sees on its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from edge.serve.warmscope import in_warmup, is_warm, request_scope

if TYPE_CHECKING:
    from edge.serve.worker import EngineWorker, ModelWorker

__all__ = ["Metrics", "MetricsMiddleware", "UNMATCHED"]

UNMATCHED = "<unmatched>"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

T = TypeVar("T")
ASGIApp = Any  # (scope, receive, send) -> awaitable


class Metrics:
    """The service's metric families, in a registry of their own (tests build their own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("edge_requests", "HTTP requests answered, by route template, "
                                "method and status (warm-up excluded).",
                                ["route", "method", "status"], registry=reg)
        self.duration = Histogram("edge_request_duration_seconds", "Time from the request's arrival "
                                  "to the last byte of its response body handed to the server "
                                  "(streams included) or the client's disconnect.",
                                  ["route", "method"], buckets=_DURATION_BUCKETS, registry=reg)
        self.warmup_requests = Counter("edge_warmup_requests", "Warm-up requests sent over the "
                                       "warm-up's private transport (no listener), by route and status.",
                                       ["route", "status"], registry=reg)
        self.ttft = Histogram("edge_time_to_first_token_seconds", "Time from a generation's "
                              "submission (queue wait and prefill included) to its first token.",
                              ["model"], buckets=_TTFT_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("edge_prompt_tokens", "Prompt tokens processed, by model.",
                                     ["model"], registry=reg)
        self.completion_tokens = Counter("edge_completion_tokens", "Completion tokens generated, "
                                         "by model.", ["model"], registry=reg)
        self.embed_inputs = Counter("edge_embedding_inputs", "Inputs embedded (/v1/embeddings), by model.",
                                    ["model"], registry=reg)
        self.embed_tokens = Counter("edge_embedding_tokens", "Tokens of the inputs embedded, by model.",
                                    ["model"], registry=reg)
        self.embed_batches = Counter("edge_embedding_batches", "llama.cpp decodes of embeddings batches "
                                     "holding a client's input (inputs / batches: how full they were), by model.",
                                     ["model"], registry=reg)
        self.aborts = Counter("edge_client_aborts", "Generations stopped early because the client "
                              "went away, by model.", ["model"], registry=reg)
        self.shed = Counter("edge_connections_shed", "Connections closed at server.max_connections "
                            "to admit new ones: those that had waited longest for a request head "
                            "(idle keep-alive ones included).", registry=reg)
        self.refused = Counter("edge_http_unauthorized", "Requests refused with 401 before any work "
                               "(edge.serve.auth): no API key sent (reason=missing) or one not "
                               "accepted (reason=invalid).", ["reason"], registry=reg)
        for reason in ("missing", "invalid"):
            self.refused.labels(reason)  # both series exist from the start, at 0
        self.open_sockets = Gauge("edge_sockets_without_key", "Listening sockets other machines can "
                                  "reach that the serving set answers with no API key "
                                  "(server.allow_unauthenticated = true), as the start or the last "
                                  "reload left them.", registry=reg)
        self.opened = Counter("edge_served_without_key", "Starts and reloads that served a socket "
                              "other machines can reach with no API key, by event (start, reload).",
                              ["event"], registry=reg)
        self._state = _StateCollector()
        reg.register(self._state)
        self._fleet: Any = None  # edge.fleet.metrics.FleetCollector, once the state dir is known

    # -- what the app records ------------------------------------------------------------------
    def tokens(self, prompt: int, completion: int, model: str = "") -> None:
        if in_warmup():
            return
        self.prompt_tokens.labels(model).inc(prompt)
        self.completion_tokens.labels(model).inc(completion)

    def embedded(self, model: str, inputs: int, tokens: int) -> None:
        """One embeddings request's inputs and their tokens (warm-up's not counted)."""
        if not in_warmup():
            self.embed_inputs.labels(model).inc(inputs)
            self.embed_tokens.labels(model).inc(tokens)

    def embed_batch(self, model: str, client_inputs: int) -> None:
        """An embeddings batch decoded; counted where a client's input was in it."""
        if client_inputs:
            self.embed_batches.labels(model).inc()

    async def generation(self, model: str, pieces: AsyncIterator[T]) -> AsyncIterator[T]:
        """`pieces` passed through, timing the first one: from when it was made (`piece.at`,
        stamped on the generating thread) where it says, else from its arrival (client aborts
        are counted by the route, which knows whether the client left: `client_abort`)."""
        t0, first, warm = time.perf_counter(), True, in_warmup()
        try:
            async for piece in pieces:
                if first and not warm:
                    made = getattr(piece, "at", 0.0) or time.perf_counter()
                    self.ttft.labels(model).observe(max(0.0, made - t0))
                first = False
                yield piece
        finally:
            # `async for` does not close what it iterates: stop the generation behind it now,
            # not when the garbage collector gets to it.
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()

    def client_abort(self, model: str) -> None:
        """The client went away before its answer was whole (queued, generating or streaming)."""
        if not in_warmup():
            self.aborts.labels(model).inc()

    def unauthorized(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def served_without_keys(self, sockets: list[str], event: str) -> None:
        """A start or a reload's switch: the sockets others can reach that its set serves with no key."""
        self.open_sockets.set(len(sockets))
        if sockets:
            self.opened.labels(event).inc()

    def connections_shed(self, n: int) -> None:
        self.shed.inc(n)

    def set_phases(self, phases: Iterable[dict[str, Any]], event: str = "start") -> None:
        """The phases of a start report (`report["phases"]`); a later call for the same event
        (a reload) replaces that event's phases."""
        self._state.phases[event] = _phase_samples(phases)

    def track_fleet(self, state_dir: Path) -> None:
        """Add the identity and history families (edge.fleet.metrics) read from `state_dir` and
        from the serving set; once, at the first READY (a reload's set shares these metrics)."""
        if self._fleet is None:
            from edge.fleet.metrics import FleetCollector

            self._fleet = FleetCollector(state_dir, lambda: self._state.state)
            self.registry.register(self._fleet)

    # -- what the app serves -------------------------------------------------------------------
    def instrument(self, app: ASGIApp, state: Any) -> "MetricsMiddleware":
        """`app` wrapped in the timing middleware; readiness and queue depths read from `state`
        at each scrape."""
        self._state.bind(state)
        return MetricsMiddleware(app, self)

    def render(self, state: Any = None) -> str:
        """The text exposition (the state was bound by `instrument`)."""
        return generate_latest(self.registry).decode("utf-8")

    def _observe(self, route: str, method: str, status: int, seconds: float, warm: bool) -> None:
        if warm:
            self.warmup_requests.labels(route, str(status)).inc()
            return
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route, method).observe(seconds)


def _phase_samples(phases: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    for p in phases:
        detail = p.get("detail") or {}
        kind = "model" if "model" in detail else "engine" if "engine" in detail else ""
        key = (str(p["name"]), str(detail.get(kind, "")) if kind else "", kind)
        out[key] = out.get(key, 0.0) + float(p["seconds"])  # a phase run twice for one target: summed
    return out


class _StateCollector:
    """Families read from the live service at scrape time: readiness, queue depths, phases."""

    def __init__(self) -> None:
        self._serving: Any = None  # the last bound state that became ready
        self._newest: Any = None  # the last bound state: a reload's new set, before its switch
        self.phases: dict[str, dict[tuple[str, str, str], float]] = {}

    def bind(self, state: Any) -> None:
        if self._newest is not None and self._newest.ready:
            self._serving = self._newest
        self._newest = state

    @property
    def state(self) -> Any:
        """The set that serves. A reload builds its new set's app (and binds it) before the
        switch, and a failed reload's set never serves: until it is ready, the one before is."""
        new = self._newest
        return new if new is None or new.ready or self._serving is None else self._serving

    def describe(self) -> list[Metric]:
        return []  # families depend on the state; nothing to check for clashes up front

    def collect(self) -> Iterator[Metric]:
        st = self.state
        ready = GaugeMetricFamily("edge_ready", "1 once warm-up finished and the service accepts "
                                  "traffic; 0 while starting or draining.")
        ready.add_metric([], float(bool(st is not None and st.ready and not st.stopping)))
        yield ready
        depth = GaugeMetricFamily("edge_queue_depth", "Requests queued or running on a model's or "
                                  "engine's worker.", labels=["model", "kind"])
        for kind, workers in (("model", getattr(st, "workers", {})), ("engine", getattr(st, "engines", {}))):
            for name, worker in workers.items():
                depth.add_metric([name, kind], float(getattr(worker, "pending", 0)))
        yield depth
        yield from _prompt_cache_families(getattr(st, "workers", {}))
        yield from _batch_families(getattr(st, "engines", {}))
        yield from _slot_families(getattr(st, "workers", {}))
        phases = GaugeMetricFamily("edge_start_phase_seconds", "Duration of each phase of the last "
                                   "start (event=start) or reload, per model or engine (empty for "
                                   "process-wide phases).", labels=["event", "phase", "model", "kind"])
        for event, samples in self.phases.items():
            for (phase, target, kind), seconds in samples.items():
                phases.add_metric([event, phase, target, kind], seconds)
        yield phases


def _prompt_cache_families(workers: dict[str, ModelWorker]) -> Iterator[Metric]:
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


def _batch_families(engines: dict[str, EngineWorker]) -> Iterator[Metric]:
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


def _slot_families(workers: dict[str, ModelWorker]) -> Iterator[Metric]:
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


class MetricsMiddleware:
    """Times each HTTP request from arrival to the last body chunk sent (or the disconnect)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.routes = getattr(app, "routes", [])

    def route_of(self, scope: dict[str, Any]) -> str:
        """The template of the route that matches the path, also when only the method does not
        (a 405); `<unmatched>` for a 404."""
        from starlette.routing import Match

        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", UNMATCHED)
            if match == Match.PARTIAL and partial is None:
                partial = getattr(route, "path", UNMATCHED)
        return partial or UNMATCHED

    def observe(self, scope: dict[str, Any], status: int, seconds: float) -> None:
        """One request answered outside this middleware (the limits layer), counted as if here."""
        method = scope["method"] if scope["method"] in _METHODS else "OTHER"
        self.metrics._observe(self.route_of(scope), method, status, seconds,
                              is_warm(scope))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status, done, gone, failed = 500, False, False, False

        def record() -> None:
            nonlocal done
            if not done:
                done = True
                self.observe(scope, status, time.perf_counter() - t0)

        async def watched_receive() -> dict[str, Any]:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def timed_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last and gone:
                status = 499  # the server drops what is sent after a disconnect: nobody read it
            await send(message)
            if last:
                record()

        try:
            with request_scope(scope):
                await self.app(scope, watched_receive, timed_send)
        except BaseException:
            failed = True
            raise
        finally:
            # Ended before its last chunk: the client went away (a stream cut short is 499, like
            # an abandoned non-streamed request), or the app failed.
            status = 499 if gone else 500 if failed else status
            record()

