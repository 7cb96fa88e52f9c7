"""Prometheus metrics under the `chatserve:` prefix, in a per-app CollectorRegistry.

Gauges and counters are read from the engine at scrape time; histograms are fed by the engine's
observer hook (per request, per step) and by the HTTP guard (per response). The names follow vLLM's, so
a vLLM dashboard works with the prefix swapped. Not the periodic stats line (serve.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from chatserve.engine import AsyncEngine

CONTENT_TYPE = CONTENT_TYPE_LATEST      # what generate_latest writes, as prometheus_client names it
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
                  200000)
_N_BUCKETS = (1, 2, 5, 10, 20)
_HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)
# engine observation name → (metric name, help, buckets)
_ENGINE_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS),
    "queue": ("request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS),
    "prefill": ("request_prefill_time_seconds", "First scheduling to first token.", _LATENCY_BUCKETS),
    "decode": ("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS),
    "inference": ("request_inference_time_seconds", "First scheduling to last token.", _LATENCY_BUCKETS),
    "prompt_tokens": ("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS),
    "generation_tokens": ("request_generation_tokens", "Generated tokens per sequence.", _TOKEN_BUCKETS),
    "params_n": ("request_params_n", "The n parameter of each request.", _N_BUCKETS),
    "iteration_tokens": ("iteration_tokens_total", "Tokens run per engine step.", _TOKEN_BUCKETS),
}
# (family, metric name, help, EngineStats field), read from the engine at scrape time
_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
_STAT_METRICS = (
    (_GAUGE, "num_requests_running", "Sequences holding KV blocks and stepping.", "running"),
    (_GAUGE, "num_requests_waiting", "Sequences queued (incl. preempted).", "waiting"),
    (_GAUGE, "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", "kv_usage"),
    (_GAUGE, "kv_cache_used_blocks", "KV blocks referenced by live sequences.", "kv_used_blocks"),
    (_GAUGE, "kv_cache_free_blocks", "KV blocks free (incl. cached, evictable).", "kv_free_blocks"),
    (_GAUGE, "kv_cache_cached_blocks", "Free KV blocks that still hold a cached prefix.", "kv_cached_blocks"),
    (_GAUGE, "kv_cache_num_blocks", "KV blocks in the cache.", "kv_num_blocks"),
    (_GAUGE, "num_active_streams", "Client requests with a live stream.", "active_requests"),
    (_COUNTER, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    (_COUNTER, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hits"),
    (_COUNTER, "num_preemptions", "Sequences preempted for lack of KV blocks.", "preemptions"),
    (_COUNTER, "prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens"),
    (_COUNTER, "generation_tokens", "Tokens generated.", "generation_tokens"),
    (_COUNTER, "engine_step_errors", "Engine steps that failed.", "step_errors"),
    (_COUNTER, "spec_decode_num_drafts", "Speculative decoding: sequence steps verified with drafts.",
     "spec_num_drafts"),
    (_COUNTER, "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
     "spec_num_draft_tokens"),
    (_COUNTER, "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_num_accepted_tokens"),
)


class _EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model = model_name

    def describe(self):
        return []

    def collect(self):
        s = self.engine.stats()

        def family(kind: type, name: str, doc: str, value: float):
            f = kind(f"chatserve:{name}", doc, labels=["model_name"])
            f.add_metric([self.model], value)
            return f

        for kind, name, doc, attr in _STAT_METRICS:
            yield family(kind, name, doc, getattr(s, attr))
        yield family(GaugeMetricFamily, "spec_decode_draft_acceptance_rate",
                     "Speculative decoding: accepted / verified draft tokens since start (0 before any draft).",
                     s.spec_num_accepted_tokens / s.spec_num_draft_tokens if s.spec_num_draft_tokens else 0.0)
        fin = CounterMetricFamily("chatserve:request_success", "Finished sequences by reason.",
                                  labels=["model_name", "finished_reason"])
        for reason, count in sorted(s.requests_finished.items()):
            fin.add_metric([self.model, reason], count)
        yield fin
        info = self._cache_info()
        g = GaugeMetricFamily("chatserve:cache_config_info", "The KV cache's configuration (value 1).",
                              labels=list(info))
        g.add_metric(list(info.values()), 1)
        yield g

    def _cache_info(self) -> dict[str, str]:
        e, cache = self.engine, self.engine.config.cache
        # the runner's setting (before the engine has loaded a runner: the configured one)
        dtype = e.runner.kv_cache_dtype if e.runner is not None else cache.kv_cache_dtype
        return {"block_size": str(e.block_size), "num_gpu_blocks": str(e.num_blocks), "cache_dtype": str(dtype),
                "enable_prefix_caching": str(bool(cache.enable_prefix_caching)),
                "max_model_len": str(e.max_model_len)}


class Metrics:
    """Owns the registry; `render()` gives the exposition text."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        r, lab = self.registry, ["model_name"]
        self._model = model_name
        self.hist = {key: Histogram(f"chatserve:{name}", doc, lab, buckets=buckets, registry=r)
                     for key, (name, doc, buckets) in _ENGINE_HISTOGRAMS.items()}
        self.http = Counter("chatserve:http_responses", "HTTP responses by status code and route.",
                            ["code", "handler"], registry=r)
        self.http_duration = Histogram("chatserve:http_request_duration_seconds",
                                       "Request start to the end of the response (whole stream).",
                                       ["handler", "method"], buckets=_HTTP_BUCKETS, registry=r)
        engine.observers.append(self.observe)

    def observe(self, name: str, value: float) -> None:
        h = self.hist.get(name)
        if h is not None:
            h.labels(self._model).observe(max(0.0, value))

    def count_response(self, status: int, handler: str = "other", method: str = "GET",
                       seconds: float | None = None) -> None:
        """One finished HTTP response. `handler`: the matched route's path template (bounded)."""
        self.http.labels(str(status), handler).inc()
        if seconds is not None:
            self.http_duration.labels(handler, method).observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)
