"""The server's Prometheus metrics, in a registry of its own (no process-global state: two
servers in one process, as the tests run them, count apart). The engine loop updates them
after every step and as each request's tokens and end come; GET /metrics renders them.

Two sets of names side by side: ours (`kvcache_*`, unlabelled) and vLLM's (`vllm:*`, labelled
with the served model's name: runner/serve/vllm_metrics.py), so that vLLM's dashboards work
unchanged and ours keep working."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvcache import CacheStats
from runner.serve.vllm_metrics import CacheConfig, RequestEnd, VllmMetrics

# Seconds: a tiny model's first token on loopback takes ~10 ms, a long prompt queued behind
# others on the CPU minutes.
# fmt: off
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0, 600.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
               60.0)
# fmt: on
DEFAULT_MAX_MODEL_LEN = 32768  # the top of the token-count buckets when none is given


class ServeMetrics:
    """Counters, gauges and latency histograms of one server serving `model_name` (the name
    vLLM's series carry), whose requests are at most `max_model_len` tokens long."""

    def __init__(
        self, model_name: str = "kvcache", max_model_len: int = DEFAULT_MAX_MODEL_LEN
    ) -> None:
        self.registry = r = CollectorRegistry()

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.requests_running = gauge("kvcache_requests_running", "Requests in the running batch")
        self.requests_waiting = gauge(
            "kvcache_requests_waiting", "Requests queued, not yet admitted"
        )
        self.requests = counter(
            "kvcache_requests", "Requests ended, by finish reason", ("finish_reason",)
        )
        self.rejected = counter(
            "kvcache_requests_rejected", "Requests refused, by HTTP status", ("status",)
        )
        self.prompt_tokens = counter("kvcache_prompt_tokens", "Prompt tokens")
        self.cached_tokens = counter(
            "kvcache_cached_tokens", "Prompt tokens served from the prefix cache"
        )
        self.generated_tokens = counter("kvcache_generation_tokens", "Tokens generated")
        self.reused_segment_tokens = counter(
            "kvcache_reused_segment_tokens",
            "Prompt tokens served from later segments' own cache (docs/SEGMENTS.md)",
        )
        self.segment_hit_rate = gauge(
            "kvcache_segment_hit_rate",
            "Tokens of later segments served from their own cache / all asked",
        )
        self.segment_recompute_fraction = gauge(
            "kvcache_segment_recompute_fraction",
            "Of the reused segment tokens, the fraction recomputed (blend_ratio)",
        )
        self.hit_rate = gauge("kvcache_prefix_cache_hit_rate", "Prompt tokens found cached / all")
        self.blocks_in_use = gauge("kvcache_kv_blocks_in_use", "KV blocks held by running requests")
        self.blocks_total = gauge("kvcache_kv_blocks", "KV blocks in the pool")
        self.ttft = histogram(
            "kvcache_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "kvcache_inter_token_latency_seconds",
            "Between a request's consecutive tokens",
            ITL_BUCKETS,
        )
        self.vllm = VllmMetrics(r, model_name, max_model_len)

    def describe_cache(self, config: CacheConfig) -> None:
        """The pool's configuration, once (vLLM's cache_config_info)."""
        self.vllm.describe_cache(config)

    def on_step(
        self,
        running: int,
        waiting: int,
        stats: CacheStats,
        num_blocks: int,
        preemptions: int = 0,
        segments: Mapping[str, float | int] | None = None,
    ) -> None:
        """After a step (or an abort): the batch's size, the pool's state, the engine's
        preemptions so far and its segment reuse (LLM.segment_stats)."""
        if segments is not None:
            self.segment_hit_rate.set(segments["segment_hit_rate"])
            self.segment_recompute_fraction.set(segments["segment_recompute_fraction"])
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        self.hit_rate.set(stats.hit_rate)
        self.blocks_in_use.set(stats.blocks_in_use)
        self.blocks_total.set(num_blocks)
        usage = stats.blocks_in_use / num_blocks if num_blocks else 0.0
        self.vllm.on_step(
            running, waiting, usage, preemptions, stats.query_tokens, stats.hit_tokens
        )

    def on_iteration(self, tokens: int) -> None:
        """An engine step computed `tokens` positions (prompt chunks, decodes, drafts)."""
        self.vllm.iteration_tokens.observe(tokens)

    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        """A request's first token, `ttft_s` after its arrival."""
        self.ttft.observe(ttft_s)
        self.vllm.on_first_token(ttft_s, prompt_tokens)

    def on_tokens(self, count: int, gap_s: float | None, sample_index: int) -> None:
        """`count` new tokens of one sample; `gap_s` each one's share of the time since that
        sample's last tokens (None: its first). Our inter-token histogram times sample 0."""
        if gap_s is not None and sample_index == 0:
            for _ in range(count):
                self.itl.observe(gap_s)
        self.vllm.on_tokens(count, gap_s)

    def on_finish(
        self, finish_reason: str, prompt: int, cached: int, generated: int, reused: int = 0
    ) -> None:
        """A request that ran to its end (not an abort): our counters."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.reused_segment_tokens.inc(reused)
        self.generated_tokens.inc(generated)

    def on_end(self, end: RequestEnd) -> None:
        """Any request that ended, aborted ones too: vLLM's per-request series."""
        self.vllm.on_end(end)

    def render(self) -> bytes:
        return generate_latest(self.registry)
