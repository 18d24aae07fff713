"""Prometheus text exposition of the service's counters; no client library needed."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["Metrics"]

_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.latency_buckets: Counter[tuple[str, float]] = Counter()
        self.latency_sum: Counter[str] = Counter()
        self.latency_count: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.client_aborts = 0
        self.start_phases: dict[str, float] = {}

    def request(self, path: str, status: int, seconds: float) -> None:
        self.requests[(path, status)] += 1
        self.latency_sum[path] += seconds
        self.latency_count[path] += 1
        for b in _BUCKETS:
            if seconds <= b:
                self.latency_buckets[(path, b)] += 1

    def tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def client_abort(self) -> None:
        self.client_aborts += 1

    def render(self, state: Any) -> str:
        out = [
            "# HELP edge_ready 1 once warm-up finished and the service accepts traffic.",
            "# TYPE edge_ready gauge",
            f"edge_ready {int(state.ready and not state.stopping)}",
            "# TYPE edge_requests_total counter",
        ]
        out += [f'edge_requests_total{{path="{p}",status="{s}"}} {n}'
                for (p, s), n in sorted(self.requests.items())]
        out.append("# TYPE edge_request_seconds histogram")
        for path in sorted(self.latency_count):
            for b in _BUCKETS:
                out.append(f'edge_request_seconds_bucket{{path="{path}",le="{b}"}} '
                           f"{self.latency_buckets[(path, b)]}")
            out.append(f'edge_request_seconds_bucket{{path="{path}",le="+Inf"}} {self.latency_count[path]}')
            out.append(f'edge_request_seconds_sum{{path="{path}"}} {self.latency_sum[path]:.6f}')
            out.append(f'edge_request_seconds_count{{path="{path}"}} {self.latency_count[path]}')
        out += ["# TYPE edge_prompt_tokens_total counter", f"edge_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE edge_completion_tokens_total counter",
                f"edge_completion_tokens_total {self.completion_tokens}",
                "# TYPE edge_client_aborts_total counter", f"edge_client_aborts_total {self.client_aborts}",
                "# TYPE edge_queue_depth gauge"]
        out += [f'edge_queue_depth{{model="{n}"}} {w.pending}' for n, w in state.workers.items()]
        out.append("# TYPE edge_start_phase_seconds gauge")
        out += [f'edge_start_phase_seconds{{phase="{k}"}} {v:.4f}' for k, v in self.start_phases.items()]
        return "\n".join(out) + "\n"
