"""Prometheus metrics of one server: a registry per app (no process-global state), engine gauges read at scrape.

Every measurement is exported twice: under Ember's own `ember_*` names and under the `vllm:*` names (with a
`model_name` label) that Grafana dashboards and autoscalers built for vLLM already scrape.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # ember's inter-token latency: finer than vLLM's below 10 ms
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_CACHE_INFO = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_gpu_blocks")
"""The `vllm:cache_config_info` labels Ember has (vLLM's CacheConfig fields of those names)."""
_FINISH_REASONS = ("eos", "stop_string", "length", "abort", "error", "cancelled", "pooled")
"""Every `ember_request_finished_total` reason, each series exported from startup."""
_VLLM_REASONS = {"eos": "stop", "stop_string": "stop", "pooled": "stop", "length": "length", "abort": "abort",
                       "cancelled": "abort", "error": "error"}
"""vLLM's finished_reason of each Ember reason (vLLM's FinishReason also has ``repetition``, which Ember never ends
with: exported at 0)."""


def _buckets_1_2_5(top: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``top``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


UNMEASURED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version"})  # vLLM's excluded_handlers


class _Both:
    """One measurement recorded under two metrics (Ember's name and vLLM's)."""

    def __init__(self, *targets: Any):
        self.targets = targets

    def observe(self, value: float) -> None:
        for t in self.targets:
            t.observe(value)

    def inc(self, amount: float = 1) -> None:
        for t in self.targets:
            t.inc(amount)


class Metrics:
    """Counters and histograms updated by the request handlers; gauges refreshed from `stats()` on each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], object], max_model_len: int = 10**6):
        """``max_model_len`` (the engine's) tops the token-count histograms' 1-2-5 buckets, as in vLLM."""
        self.registry = CollectorRegistry()
        self._stats = stats
        self.model_name = model_name
        r = self.registry
        m = ["model_name"]
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*, as vLLM's
            r.register(collector)
        self.requests = Counter("ember_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["handler", "method", "status"], registry=r)  # as vLLM's instrumentator
        self.http_duration = Histogram("http_request_duration_seconds",
                                       "Latency with only few buckets by handler. Made to be only used if aggregation "
                                       "by handler is important.", ["handler", "method"], buckets=(0.1, 0.5, 1.0),
                                       registry=r)
        self._cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", _CACHE_INFO,
                                 registry=r)
        self.prompt_tokens = _Both(
            Counter("ember_prompt_tokens", "Prompt tokens admitted", registry=r),
            Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r).labels(model_name))
        self.generation_tokens = _Both(
            Counter("ember_generation_tokens", "Tokens generated", registry=r),
            Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                    registry=r).labels(model_name))
        self._finished = Counter("ember_request_finished", "Finished choices by finish reason", ["reason"],
                                 registry=r)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*m, "finished_reason"], registry=r)
        for reason in _FINISH_REASONS:
            self._finished.labels(reason)
        for vllm_reason in (*dict.fromkeys(_VLLM_REASONS.values()), "repetition"):
            self._success.labels(model_name, vllm_reason)
        self.ttft = _Both(
            Histogram("ember_time_to_first_token_seconds", "Time from admission to the first token",
                      buckets=_TTFT_BUCKETS, registry=r),
            Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m,
                      buckets=_TTFT_BUCKETS, registry=r).labels(model_name))
        self.itl = Histogram("ember_inter_token_latency_seconds", "Time between consecutive tokens of a choice",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  m, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)  # vLLM's le, per step
        self.e2e = _Both(
            Histogram("ember_request_latency_seconds", "Time from admission to the last token",
                      buckets=_REQUEST_BUCKETS, registry=r),
            Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m,
                      buckets=_REQUEST_BUCKETS, registry=r).labels(model_name))
        def vllm_histogram(name: str, text: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, text, m, buckets=buckets, registry=r).labels(model_name)

        tokens = _buckets_1_2_5(max_model_len)
        self.queue_time = vllm_histogram("vllm:request_queue_time_seconds",
                                         "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS)
        self._prompt_len = vllm_histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self._generated = vllm_histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                         tokens)
        self._max_tokens = vllm_histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", tokens)
        self._decode = vllm_histogram("vllm:request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS)
        self._prefill = vllm_histogram("vllm:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS)
        self._inference = vllm_histogram("vllm:request_inference_time_seconds",
                                         "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        self._tpot = vllm_histogram("vllm:request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.", _TPOT_BUCKETS)
        self._max_generated = vllm_histogram("vllm:request_max_num_generation_tokens",
                                             "Histogram of maximum number of requested generation tokens.", tokens)
        self._n = vllm_histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.running = Gauge("ember_num_requests_running", "Sequences running in the engine", registry=r)
        self.waiting = Gauge("ember_num_requests_waiting", "Sequences waiting in the engine", registry=r)
        self.kv_usage = Gauge("ember_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)
        self.kv_free = Gauge("ember_kv_cache_free_blocks", "Free KV-cache blocks", registry=r)
        self.v_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m,
                               registry=r).labels(model_name)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m,
                               registry=r).labels(model_name)
        self.v_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m,
                                registry=r).labels(model_name)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", m,
                                      registry=r).labels(model_name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   m, registry=r).labels(model_name)
        spec_drafts = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m,
                              registry=r).labels(model_name)
        spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", m,
                                registry=r).labels(model_name)
        spec_chunks = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m,
                              registry=r).labels(model_name)
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.", [*m, "position"], registry=r)
        preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m,
                              registry=r).labels(model_name)
        self._lora_info: Gauge | None = None  # vLLM's, registered at the first scrape of an engine serving LoRA
        self._model_name = model_name
        self._totals = {"prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                        "spec_draft_tokens": spec_drafts, "spec_accepted_tokens": spec_accepted,
                        "spec_drafts": spec_chunks, "num_preemptions": preemptions}
        """Engine totals (`EngineStats` fields) exported as counters, by what each scrape adds."""
        self._seen: dict[object, int] = {}  # each exported total's value at the previous scrape

    def cache_config(self, **info: object) -> None:
        """vLLM's ``vllm:cache_config_info`` (1, its facts as labels): ``info`` holds the `_CACHE_INFO` keys."""
        self._cache_info.labels(*(str(info[k]) for k in _CACHE_INFO)).set(1)

    def http_request(self, handler: str | None, method: str, status: int, seconds: float) -> None:
        """One HTTP response, in vLLM's HTTP metrics as its instrumentator counts them: status grouped as ``2xx``, a
        path no route serves (``handler`` None) as ``none``, and the probes and scrapes (`UNMEASURED_HANDLERS`) left
        out."""
        if handler in UNMEASURED_HANDLERS:
            return
        handler = handler or "none"
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_duration.labels(handler, method).observe(seconds)

    def finished(self, reason: str, rejected: bool = False) -> None:
        """A choice ended for ``reason`` (`ember_request_finished_total`), counted as vLLM's finished_reason too
        (`_VLLM_REASONS`) unless the engine ``rejected`` it (a 400, which vLLM refuses before its engine)."""
        self._finished.labels(reason).inc()
        if not rejected:
            self._success.labels(self._model_name, _VLLM_REASONS.get(reason, "abort")).inc()

    def tokens_arrived(self, tokens: int, steps: int, since_last: float | None) -> None:
        """An output of ``tokens`` tokens from ``steps`` engine steps, ``since_last`` seconds after the choice's
        previous output (None: its first). Ember's inter-token latency counts a gap per token, vLLM's one per step (a
        speculative step's accepted tokens arrive together); an output merged from several steps while its client
        lagged spreads the interval evenly, and tokens that came with the first output arrived with it."""
        if since_last is None:
            per_token, per_step, tokens, steps = 0.0, 0.0, tokens - 1, steps - 1
        else:
            per_token, per_step = since_last / tokens, since_last / steps
        for _ in range(tokens):
            self.itl.observe(per_token)
        for _ in range(steps):
            self.step_itl.observe(per_step)

    def choice_ran(self, prompt_tokens: int, generated: int, max_tokens: int | None, first_token: float | None,
                   last_token: float | None, scheduled_at: float | None = None) -> None:
        """vLLM's per-request histograms of a choice the engine ran (one vLLM request), its first and last tokens
        received at ``first_token`` and ``last_token`` (None: it produced none, so no decode phase is known), first
        scheduled by the engine at ``scheduled_at`` (`time.monotonic()`, as the others; None: unknown, so no prefill
        or inference phase is)."""
        self._prompt_len.observe(prompt_tokens)
        self._generated.observe(generated)
        if max_tokens is not None:  # an echo of max_tokens 0 as vLLM runs it: for 1 token
            self._max_tokens.observe(max(max_tokens, 1))
        if first_token is not None and last_token is not None:
            decode = last_token - first_token
            self._decode.observe(decode)
            self._tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)
            if scheduled_at is not None:
                self._prefill.observe(first_token - scheduled_at)
                self._inference.observe(last_token - scheduled_at)

    def prompt_done(self, n: int, max_generated: int) -> None:
        """Every one of the ``n`` choices of one prompt ended, the longest with ``max_generated`` tokens."""
        self._n.observe(n)
        self._max_generated.observe(max_generated)

    def render(self) -> bytes:
        s = self._stats()
        running, waiting = getattr(s, "num_running", 0), getattr(s, "num_waiting", 0)
        usage = getattr(s, "kv_usage", 0.0)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(usage)
        self.kv_free.set(getattr(s, "num_free_blocks", 0))
        self.v_running.set(running)
        self.v_waiting.set(waiting)
        self.v_kv_usage.set(usage)
        for name, counter in self._totals.items():
            self._add(name, counter, getattr(s, name, 0))
        for pos, total in enumerate(getattr(s, "spec_accepted_per_pos", ())):
            self._add(("spec_accepted_per_pos", pos), self._per_pos.labels(self._model_name, str(pos)), total)
        max_loras = getattr(s, "max_loras", 0)
        if max_loras:
            self._lora_requests(max_loras, getattr(s, "running_lora_adapters", ()),
                                getattr(s, "waiting_lora_adapters", ()))
        return generate_latest(self.registry)

    def _lora_requests(self, max_loras: int, running: Any, waiting: Any) -> None:
        """vLLM's `vllm:lora_requests_info`: one series whose labels name the adapters of the running and the
        waiting requests (comma-joined) and the adapter slots, valued at the time (`time.time()`) they were read.
        The previous scrape's series goes (vLLM keeps every combination ever seen; readers take the latest value)."""
        if self._lora_info is None:
            self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                    registry=self.registry)
        self._lora_info.clear()
        self._lora_info.labels(str(max_loras), ",".join(waiting), ",".join(running)).set_to_current_time()

    def _add(self, key: object, counter: Any, total: int) -> None:
        """Advance ``counter`` by what the engine total under ``key`` gained since the previous scrape."""
        seen = self._seen.get(key, 0)
        counter.inc(max(0, total - seen))
        self._seen[key] = max(total, seen)
