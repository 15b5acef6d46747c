"""Prometheus metrics of the HTTP gateway, in a registry of their own (so several apps can coexist).

Latencies are measured where the user sees them, at the gateway: TTFT from the HTTP request's arrival
to the first generated token, ITL between consecutive tokens. Engine-side state (running requests,
kvd connectivity, the engine's own counters) is read from ``engine.stats()`` over IPC at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# TTFT spans a 1 ms cached hit on the GPU to seconds for a cold 100k prompt on the CPU.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Counters and histograms the gateway updates; ``render`` produces the text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specd_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.cached_tokens = Counter("specd_cached_prompt_tokens",
                                     "Prompt tokens served from the KV cache instead of prefilled.", registry=r)
        self.ttft = Histogram("specd_time_to_first_token_seconds", "HTTP arrival to first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specd_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specd_request_latency_seconds", "HTTP arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.engine_up = Gauge("specd_engine_up", "1 if the engine answered this scrape's stats request.",
                               registry=r)
        self.kvd_connected = Gauge("specd_kvd_connected",
                                   "1 if the engine uses kvd's shared cache, 0 if it serves without it.", registry=r)
        self.requests_running = Gauge("specd_requests_running", "Requests the engine is working on.", registry=r)
        self.engine_stat = Gauge("specd_engine_stat", "Every counter of engine.stats(), by name.", ["name"],
                                 registry=r)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)

    def set_engine_stats(self, stats: dict[str, float | int] | None) -> None:
        """Copy a stats snapshot into the gauges; ``None`` means the engine did not answer."""
        self.engine_up.set(0 if stats is None else 1)
        if stats is None:
            return
        self.kvd_connected.set(stats.get("kvd_connected", 0))
        self.requests_running.set(stats.get("requests_running", 0))
        for name, value in stats.items():
            self.engine_stat.labels(name=name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
