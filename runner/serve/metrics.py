"""The server's Prometheus metrics, in a registry of its own (no process-global state: two
servers in one process, as the tests run them, count apart). The engine loop updates them
after every step; GET /metrics renders them."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: a tiny model's first token on loopback takes ~10 ms, a long prompt on the CPU seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    """Counters, gauges and latency histograms of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "kvcache_requests_running", "Requests in the running batch", registry=r
        )
        self.requests_waiting = Gauge(
            "kvcache_requests_waiting", "Requests queued, not yet admitted", registry=r
        )
        self.requests = Counter(
            "kvcache_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "kvcache_requests_rejected", "Requests refused, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("kvcache_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvcache_cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generated_tokens = Counter("kvcache_generation_tokens", "Tokens generated", registry=r)
        self.hit_rate = Gauge(
            "kvcache_prefix_cache_hit_rate",
            "Prompt tokens found cached / all",
            registry=r,
        )
        self.blocks_in_use = Gauge(
            "kvcache_kv_blocks_in_use", "KV blocks held by running requests", registry=r
        )
        self.blocks_total = Gauge("kvcache_kv_blocks", "KV blocks in the pool", registry=r)
        self.ttft = Histogram(
            "kvcache_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvcache_inter_token_latency_seconds",
            "Between a request's consecutive tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )

    def on_step(self, running: int, waiting: int, stats: Any, num_blocks: int) -> None:
        """After a step: the batch's size and the pool's state (`stats`: kvcache's CacheStats)."""
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        self.hit_rate.set(stats.hit_rate)
        self.blocks_in_use.set(stats.blocks_in_use)
        self.blocks_total.set(num_blocks)

    def on_finish(self, finish_reason: str, prompt: int, cached: int, generated: int) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generated_tokens.inc(generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
