"""Prometheus metrics under the `chatserve:` prefix, in a per-app CollectorRegistry.

Gauges and counters are read from the engine at scrape time; latency histograms are fed by the
engine's observer hook. Not the periodic stats line (serve.py).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)


class _EngineCollector:
    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model = model_name

    def describe(self):
        return []

    def collect(self):
        s = self.engine.stats()
        lab = ["model_name"]
        v = [self.model]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"chatserve:{name}", doc, labels=lab)
            g.add_metric(v, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"chatserve:{name}", doc, labels=lab)
            c.add_metric(v, value)
            return c

        yield gauge("num_requests_running", "Sequences holding KV blocks and stepping.", s.running)
        yield gauge("num_requests_waiting", "Sequences queued (incl. preempted).", s.waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", s.kv_usage)
        yield gauge("kv_cache_used_blocks", "KV blocks referenced by live sequences.", s.kv_used_blocks)
        yield gauge("kv_cache_free_blocks", "KV blocks free (incl. cached, evictable).", s.kv_free_blocks)
        yield gauge("kv_cache_cached_blocks", "Free KV blocks that still hold a cached prefix.",
                    s.kv_cached_blocks)
        yield gauge("kv_cache_num_blocks", "KV blocks in the cache.", s.kv_num_blocks)
        yield gauge("num_active_streams", "Client requests with a live stream.", s.active_requests)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.", s.preemptions)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("engine_step_errors", "Engine steps that failed.", s.step_errors)
        fin = CounterMetricFamily("chatserve:request_success", "Finished sequences by reason.",
                                  labels=["model_name", "finished_reason"])
        for reason, count in sorted(s.requests_finished.items()):
            fin.add_metric([self.model, reason], count)
        yield fin


class Metrics:
    """Owns the registry; `render()` gives the exposition text."""

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        r, lab = self.registry, ["model_name"]
        self._model = model_name
        self.hist = {
            "ttft": Histogram("chatserve:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r),
            "itl": Histogram("chatserve:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=_ITL_BUCKETS, registry=r),
            "e2e": Histogram("chatserve:e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r),
            "queue": Histogram("chatserve:request_queue_time_seconds", "Arrival to first scheduling.", lab,
                               buckets=_LATENCY_BUCKETS, registry=r),
        }
        self.http = Counter("chatserve:http_responses", "HTTP responses by status code.", ["code"],
                            registry=r)
        engine.observers.append(self.observe)

    def observe(self, name: str, value: float) -> None:
        h = self.hist.get(name)
        if h is not None:
            h.labels(self._model).observe(max(0.0, value))

    def count_response(self, status: int) -> None:
        self.http.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
