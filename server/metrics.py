"""Prometheus metrics of one server: a registry per app (no process-global state), engine gauges read at scrape."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    """Counters and histograms updated by the request handlers; gauges refreshed from `stats()` on each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], object]):
        self.registry = CollectorRegistry()
        self._stats = stats
        self.model_name = model_name
        r = self.registry
        self.requests = Counter("ember_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("ember_request_finished", "Finished choices by finish reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Time from admission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ember_inter_token_latency_seconds", "Time between consecutive tokens of a choice",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ember_request_latency_seconds", "Time from admission to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("ember_num_requests_running", "Sequences running in the engine", registry=r)
        self.waiting = Gauge("ember_num_requests_waiting", "Sequences waiting in the engine", registry=r)
        self.kv_usage = Gauge("ember_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)
        self.kv_free = Gauge("ember_kv_cache_free_blocks", "Free KV-cache blocks", registry=r)

    def render(self) -> bytes:
        s = self._stats()
        self.running.set(getattr(s, "num_running", 0))
        self.waiting.set(getattr(s, "num_waiting", 0))
        self.kv_usage.set(getattr(s, "kv_usage", 0.0))
        self.kv_free.set(getattr(s, "num_free_blocks", 0))
        return generate_latest(self.registry)
