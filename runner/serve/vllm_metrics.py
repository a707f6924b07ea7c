"""The server's metrics under vLLM's names (`vllm:` prefix, labels `model_name` and `engine`),
so that a Grafana dashboard or an autoscaler written for vLLM reads this server unchanged.
They sit beside our own `kvcache_*` series (runner/serve/metrics.py), in the same registry.

vLLM v1 defines what each series means; we follow it: the gauges are the engine as it is after
a step, the token counters grow as tokens are computed (prompt tokens when a request's first
token comes, generated tokens as they come), and every request that ends (stopped, at its
length, aborted or failed) is counted once under `vllm:request_success_total{finished_reason}`
and observed once by each per-request histogram of a phase it reached (RequestEnd says which).
The histograms' buckets are vLLM's, which reach minutes (hours for the end-to-end latency)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runner.engine.sequence import Sequence

# vLLM's bucket boundaries, in seconds (first token; per output token; a request's phases).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")
LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine a server (vLLM numbers the engines of a data-parallel server)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets up to the context)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestEnd(NamedTuple):
    """One ended request as vLLM's per-request histograms see it. Times are seconds from its
    arrival at the server; a phase it never reached is None (a request aborted in the queue
    has no prefill), and a request with fewer than two tokens has no time per output token."""

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int  # of every sample
    max_generation_tokens: int  # of its longest sample
    n: int
    max_tokens: int
    e2e_s: float  # arrival -> end
    queue_s: float  # arrival -> first admitted to the batch (or -> end, if never admitted)
    prefill_s: float | None  # first admitted -> first token
    decode_s: float | None  # first token -> last token
    inference_s: float | None  # first admitted -> last token
    tpot_s: float | None  # sample 0's decode time / its tokens after the first


def request_end(seqs: Seq[Sequence], arrival: float, now: float, reason: str) -> RequestEnd:
    """The RequestEnd of a request whose sequences (its n samples) are `seqs`, which arrived
    at `arrival` and ends at `now` (time.perf_counter, as the engine's own timings)."""
    admitted = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    lasts = [s.token_times[-1] for s in seqs if s.token_times]
    start = min(admitted) if admitted else None
    first = min(firsts) if firsts else None
    last = max(lasts) if lasts else None
    times = seqs[0].token_times
    params = seqs[0].params
    return RequestEnd(
        finish_reason=reason,
        prompt_tokens=seqs[0].num_prompt_tokens,
        generation_tokens=sum(len(s.output_token_ids) for s in seqs),
        max_generation_tokens=max(len(s.output_token_ids) for s in seqs),
        n=max(len(seqs), params.n),  # a sample's own params may say 1
        max_tokens=params.max_tokens or 0,
        e2e_s=now - arrival,
        queue_s=(start if start is not None else now) - arrival,
        prefill_s=None if start is None or first is None else first - start,
        decode_s=None if first is None or last is None else last - first,
        inference_s=None if start is None or last is None else last - start,
        tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
    )


class CacheConfig(NamedTuple):
    """What `vllm:cache_config_info` shows of the KV pool (a gauge of 1 with these labels)."""

    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str


# vLLM's per-request histograms, in its order: the RequestEnd field each observes (a phase the
# request never reached, None, is not observed), the series, its help and its buckets (None:
# token counts' buckets, up to the context length).
PER_REQUEST: tuple[tuple[str, str, str, Seq[float] | None], ...] = (
    (
        "tpot_s",
        "vllm:request_time_per_output_token_seconds",
        "A request's decode time / its tokens after the first",
        TOKEN_GAP_BUCKETS,
    ),
    ("e2e_s", "vllm:e2e_request_latency_seconds", "Arrival to end", PHASE_BUCKETS),
    ("queue_s", "vllm:request_queue_time_seconds", "Arrival to first admission", PHASE_BUCKETS),
    (
        "prefill_s",
        "vllm:request_prefill_time_seconds",
        "First admission to first token",
        PHASE_BUCKETS,
    ),
    ("decode_s", "vllm:request_decode_time_seconds", "First token to last token", PHASE_BUCKETS),
    (
        "inference_s",
        "vllm:request_inference_time_seconds",
        "First admission to last token",
        PHASE_BUCKETS,
    ),
    ("prompt_tokens", "vllm:request_prompt_tokens", "Prompt tokens a request", None),
    ("generation_tokens", "vllm:request_generation_tokens", "Tokens a request generated", None),
    (
        "max_generation_tokens",
        "vllm:request_max_num_generation_tokens",
        "Tokens a request's longest sample generated",
        None,
    ),
    ("n", "vllm:request_params_n", "The request's n", N_BUCKETS),
    ("max_tokens", "vllm:request_params_max_tokens", "The request's max_tokens", None),
)


class VllmMetrics:
    """vLLM's series of one server, for `model_name`, in `registry`: the engine's state after a
    step, the tokens as they come, each request once as it ends, the KV cache's configuration."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.registry = registry
        self._labels = (model_name, ENGINE)
        self._step_series()
        self.success = Counter(
            "vllm:request_success",
            "Requests ended, by finish reason",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        for reason in FINISH_REASONS:  # each shown from the start, at 0
            self.success.labels(*self._labels, reason)
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Between consecutive tokens", TOKEN_GAP_BUCKETS
        )
        self.tpot = self._histogram(
            "vllm:time_per_output_token_seconds",
            "Between consecutive tokens (vLLM's older name of the inter-token latency)",
            TOKEN_GAP_BUCKETS,
        )
        token_buckets = one_two_five(max_model_len)
        self.per_request = {
            field: self._histogram(name, doc, token_buckets if buckets is None else buckets)
            for field, name, doc, buckets in PER_REQUEST
        }
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total", "Tokens an engine step computes", ITERATION_TOKEN_BUCKETS
        )
        self._cache_info = Gauge(
            "vllm:cache_config_info",
            "The KV cache's configuration",
            (*LABELS, *CacheConfig._fields),
            registry=registry,
        )
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}  # the engine's totals so far

    def _step_series(self) -> None:
        """The gauges and counters `on_step` sets from the engine's state after a step."""
        self.running = self._gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV blocks in use / all (0 to 1)")
        self.gpu_usage = self._gauge(
            "vllm:gpu_cache_usage_perc", "Deprecated by vLLM: vllm:kv_cache_usage_perc"
        )
        # vLLM V0's swap space, which older dashboards still query: this engine preempts by
        # recompute and never swaps, so both read 0 (its host tier is a cache, not swap space).
        self.swapped = self._gauge("vllm:num_requests_swapped", "Requests swapped out (never: 0)")
        self.cpu_usage = self._gauge(
            "vllm:cpu_cache_usage_perc", "CPU swap space in use (0 to 1; no swap space: 0)"
        )
        self.swapped.set(0)
        self.cpu_usage.set(0.0)
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self._counter("vllm:prefix_cache_hits", "Prompt tokens found cached")
        self.preemptions = self._counter("vllm:num_preemptions", "Requests preempted (recomputed)")
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Prompt tokens of started requests"
        )
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated")

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets: Seq[float]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(
            *self._labels
        )

    def describe_cache(self, config: CacheConfig) -> None:
        values = [str(v).lower() if isinstance(v, bool) else str(v) for v in config]
        self._cache_info.labels(*self._labels, *values).set(1)

    def on_step(
        self, running: int, waiting: int, usage: float, preemptions: int, queries: int, hits: int
    ) -> None:
        """The gauges, and the counters the engine keeps as running totals (each grows by what
        its total grew since the last call)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(usage)
        self.gpu_usage.set(usage)
        for key, total, counter in (
            ("preemptions", preemptions, self.preemptions),
            ("queries", queries, self.prefix_queries),
            ("hits", hits, self.prefix_hits),
        ):
            counter.inc(max(total - self._seen[key], 0))
            self._seen[key] = total

    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, count: int, gap_s: float | None) -> None:
        """`count` new tokens of a sample; `gap_s`, each one's share of the time since that
        sample's previous tokens (None for its first)."""
        self.generation_tokens.inc(count)
        if gap_s is not None:
            for _ in range(count):
                self.itl.observe(gap_s)
                self.tpot.observe(gap_s)

    def on_end(self, end: RequestEnd) -> None:
        self.success.labels(*self._labels, end.finish_reason).inc()
        for field, value in end._asdict().items():
            histogram = self.per_request.get(field)
            if histogram is not None and value is not None:
                histogram.observe(value)
