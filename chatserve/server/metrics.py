"""Prometheus metrics under the `chatserve:` prefix, in a per-app CollectorRegistry.

Gauges and counters are read from the engine at scrape time; histograms are fed by the engine's
observer hook (per request, per step) and by the HTTP guard (per response). The names follow vLLM's, so
a vLLM dashboard works with the prefix swapped. Not the periodic stats line (serve.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from chatserve.engine import AsyncEngine
    from chatserve.engine.model_pool import ModelInfo

EngineSource = Callable[[], "list[tuple[str, AsyncEngine]]"]     # the loaded models' (name, engine)

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
    """Every loaded model's engine stats at scrape time, one `model_name` label value per model."""

    def __init__(self, engines: EngineSource, models: Callable[[], list[ModelInfo]],
                 kv_budget: Callable[[], int]) -> None:
        self.engines, self.models, self.kv_budget = engines, models, kv_budget

    def describe(self):
        return []

    def collect(self):
        loaded = [(name, e, e.stats()) for name, e in self.engines()]
        for kind, name, doc, attr in _STAT_METRICS:
            f = kind(f"chatserve:{name}", doc, labels=["model_name"])
            for model, _, s in loaded:
                f.add_metric([model], getattr(s, attr))
            yield f
        rate = GaugeMetricFamily("chatserve:spec_decode_draft_acceptance_rate",
                                 "Speculative decoding: accepted / verified draft tokens since start (0 before "
                                 "any draft).", labels=["model_name"])
        fin = CounterMetricFamily("chatserve:request_success", "Finished sequences by reason.",
                                  labels=["model_name", "finished_reason"])
        kv = GaugeMetricFamily("chatserve:kv_cache_memory_bytes", "Bytes of this model's KV cache (its share "
                               "of --kv-cache-memory while several models share it): reserved, not resident; on "
                               "the CPU a page of it becomes resident when a block in it is first used.",
                               labels=["model_name"])
        info = GaugeMetricFamily("chatserve:cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=["model_name", *_CACHE_INFO_LABELS])
        for model, e, s in loaded:
            rate.add_metric([model], s.spec_num_accepted_tokens / s.spec_num_draft_tokens
                            if s.spec_num_draft_tokens else 0.0)
            for reason, count in sorted(s.requests_finished.items()):
                fin.add_metric([model, reason], count)
            kv.add_metric([model], float(getattr(e.runner, "bytes_per_block", 0) * e.num_blocks))
            info.add_metric([model, *_cache_info(e)], 1)
        yield from (rate, fin, kv, info)
        in_memory = GaugeMetricFamily("chatserve:model_loaded", "1 while the model is loaded (every configured "
                                   "model has a series).", labels=["model_name"])
        loads = CounterMetricFamily("chatserve:model_loads", "Loads of the model started since the server "
                                    "started (the first one included).", labels=["model_name"])
        infos = self.models()
        for m in infos:
            in_memory.add_metric([m.name], 1.0 if m.phase == "loaded" else 0.0)
            loads.add_metric([m.name], m.loads)
        yield from (in_memory, loads)
        budget = self.kv_budget()
        yield GaugeMetricFamily("chatserve:kv_cache_budget_bytes", "The KV cache bytes the loaded models share "
                                "(--kv-cache-memory; 0: each model sizes its own cache).", value=budget)
        yield GaugeMetricFamily("chatserve:kv_cache_budget_free_bytes", "Bytes of that budget no loaded or "
                                "loading model holds: the next load's share comes out of it.",
                                value=max(0, budget - sum(m.kv_bytes for m in infos)) if budget else 0)


_CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "max_model_len")


def _cache_info(e: AsyncEngine) -> list[str]:
    cache = e.config.cache
    # the runner's setting (before the engine has loaded a runner: the configured one)
    dtype = e.runner.kv_cache_dtype if e.runner is not None else cache.kv_cache_dtype
    return [str(e.block_size), str(e.num_blocks), str(dtype), str(bool(cache.enable_prefix_caching)),
            str(e.max_model_len)]


class Metrics:
    """Owns the registry; `render()` gives the exposition text. `engines` lists the loaded models'
    (name, engine) at scrape time; `attach` feeds a newly loaded one's observations to the histograms."""

    def __init__(self, engines: EngineSource, models: Callable[[], list[ModelInfo]] = list,
                 kv_budget: Callable[[], int] = int) -> None:
        """kv_budget: the shared KV budget at scrape time (0: none)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engines, models, kv_budget))
        r, lab = self.registry, ["model_name"]
        self.hist = {key: Histogram(f"chatserve:{name}", doc, lab, buckets=buckets, registry=r)
                     for key, (name, doc, buckets) in _ENGINE_HISTOGRAMS.items()}
        self.http = Counter("chatserve:http_responses", "HTTP responses by status code and route.",
                            ["code", "handler"], registry=r)
        self.http_duration = Histogram("chatserve:http_request_duration_seconds",
                                       "Request start to the end of the response (whole stream).",
                                       ["handler", "method"], buckets=_HTTP_BUCKETS, registry=r)

    def attach(self, model_name: str, engine: AsyncEngine) -> None:
        """Observe `engine`'s per-request and per-step figures under `model_name`."""
        engine.observers.append(lambda name, value: self.observe(name, value, model_name))

    def observe(self, name: str, value: float, model_name: str) -> None:
        h = self.hist.get(name)
        if h is not None:
            h.labels(model_name).observe(max(0.0, value))
    def count_response(self, status: int, handler: str = "other", method: str = "GET",
                       seconds: float | None = None) -> None:
        """One finished HTTP response. `handler`: the matched route's path template (bounded)."""
        self.http.labels(str(status), handler).inc()
        if seconds is not None:
            self.http_duration.labels(handler, method).observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)
