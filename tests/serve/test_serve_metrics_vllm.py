"""/metrics under vLLM's names, read as Prometheus reads it (prometheus-client's own parser):
after finished requests, one with n=2, an abort and preemptions in a small pool, every series a
vLLM dashboard queries is there with the served model's name, the counters add up to the
requests made, the per-request histograms count each request once, the KV usage is a fraction,
and our own kvcache_* series are still there beside them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvcache import LLM
from tests.serve.conftest import LiveServer, ServeFactory

POOL_BLOCKS = 12  # 192 tokens: four answers of 60 tokens at once do not fit, so some wait
STEP_S = 0.01  # per step, so that the aborted request is still running when its client leaves
MODEL = "tiny"
PROMPTS = [f"request {i} asks about cache {i}" for i in range(4)]
LONG_TOKENS = 60
# What a vLLM dashboard (vLLM's Grafana examples, llm-d's, the autoscalers') queries.
DASHBOARD_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
    "vllm:num_requests_swapped",  # vLLM V0's, which older dashboards query: 0 here
    "vllm:cpu_cache_usage_perc",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
]
OURS = [
    "kvcache_requests_running",
    "kvcache_requests_waiting",
    "kvcache_prompt_tokens_total",
    "kvcache_generation_tokens_total",
    "kvcache_kv_blocks_in_use",
    "kvcache_time_to_first_token_seconds_bucket",
    "kvcache_inter_token_latency_seconds_bucket",
]


@pytest.fixture
def small_pool_llm(tiny_llama_tok_dir: Path) -> LLM:
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=POOL_BLOCKS, max_num_seqs=8)
    real_run = llm.runner.run

    def slow_run(scheduled: list[Any]) -> Any:
        time.sleep(STEP_S)
        return real_run(scheduled)

    llm.runner.run = slow_run  # type: ignore[method-assign]
    return llm


@pytest.fixture
def small_server(serve: ServeFactory, small_pool_llm: LLM) -> Iterator[LiveServer]:
    with serve(small_pool_llm, model_name=MODEL) as server:
        yield server


def complete(url: str, prompt: str, max_tokens: int, n: int = 1) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n}
    resp = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def abort_mid_stream(url: str, prompt: str) -> int:
    """A streamed request whose client leaves a few chunks in; the chunks it got."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 150, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: {")]
    return len(got)


def wait_idle(server: LiveServer) -> None:
    deadline = time.monotonic() + 30
    while server.state.engine.live() or server.state.llm.has_unfinished():
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


def scrape(server: LiveServer) -> dict[str, list[Sample]]:
    """Every sample of /metrics by its name, as prometheus-client parses the text."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The one sample of `name` with these labels, for model "tiny"."""
    want = {"model_name": MODEL, **labels}
    found = [s for s in samples[name] if want.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, samples[name])
    return found[0].value


def test_vllm_series_count_every_request(small_server: LiveServer) -> None:
    server, llm = small_server, small_server.state.llm
    steps_before = llm.scheduler.step_count
    usage_seen: list[float] = []
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the pool preempts some of them
        running = [pool.submit(complete, server.url, p, LONG_TOKENS) for p in PROMPTS]
        for _ in range(2000):  # bounded: the four answers take a second or two
            if all(f.done() for f in running):
                break
            usage_seen.append(value(scrape(server), "vllm:kv_cache_usage_perc"))
        usages = [f.result() for f in running]
    assert usage_seen and 0 < max(usage_seen) <= 1 and min(usage_seen) >= 0, usage_seen
    usages.append(complete(server.url, PROMPTS[0], 8, n=2))
    chunks = abort_mid_stream(server.url, PROMPTS[1])
    wait_idle(server)
    steps = llm.scheduler.step_count - steps_before
    samples = scrape(server)

    for name in DASHBOARD_SERIES:
        assert name in samples, name
        assert all(s.labels["model_name"] == MODEL for s in samples[name]), samples[name]
    for name in OURS:
        assert name in samples, name
    requests = len(usages) + 1  # and the aborted one
    sampled = len(PROMPTS) + 2 + 1  # sequences: the n=2 request has two

    # Every request ended once, under its reason (ignore_eos: each ran to its length).
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 5
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    # Tokens: prompts counted once a request (the aborted one repeats PROMPTS[1]'s prompt).
    prompt_tokens = sum(u["prompt_tokens"] for u in usages) + usages[1]["prompt_tokens"]
    assert value(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(samples, "vllm:request_prompt_tokens_sum") == prompt_tokens
    completed_tokens = sum(u["completion_tokens"] for u in usages)
    assert completed_tokens == 4 * LONG_TOKENS + 2 * 8
    generated = value(samples, "vllm:generation_tokens_total")
    assert generated >= completed_tokens + chunks and chunks > 0
    assert value(samples, "vllm:request_generation_tokens_sum") == generated
    assert value(samples, "vllm:request_params_n_sum") == len(PROMPTS) + 2 + 1
    longest = value(samples, "vllm:request_max_num_generation_tokens_sum")
    assert longest == generated - 8  # the n=2 request counts its longer sample alone
    # The pool: preempted (recomputed) requests, the engine's own count; usage a fraction.
    assert value(samples, "vllm:num_preemptions_total") == llm.scheduler.num_preemptions >= 1
    stats = llm.block_manager.stats
    assert value(samples, "vllm:prefix_cache_queries_total") == stats.query_tokens
    assert value(samples, "vllm:prefix_cache_hits_total") == stats.hit_tokens
    assert 0 < stats.hit_tokens <= stats.query_tokens  # the n=2 and aborted ones hit
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert value(samples, name) == 0.0  # idle: every block free or only cached
    assert value(samples, "vllm:num_requests_running") == 0
    # Preempted requests were recomputed, never swapped out: no swap space, none in use.
    assert value(samples, "vllm:num_requests_swapped") == 0
    assert value(samples, "vllm:cpu_cache_usage_perc") == 0.0
    info = samples["vllm:cache_config_info"][0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(POOL_BLOCKS)
    assert info.labels["enable_prefix_caching"] == "true"

    # Histograms: a request each (every one was admitted and got tokens); the token gaps one
    # a token after each sample's first; a step each; buckets cumulative up to +Inf = count.
    counts = {name: value(samples, f"{name}_count") for name in HISTOGRAMS}
    for name in HISTOGRAMS[4:-1]:
        assert counts[name] == requests, name
    assert counts["vllm:time_to_first_token_seconds"] == requests
    assert counts["vllm:request_time_per_output_token_seconds"] == requests  # all had 2+
    assert counts["vllm:inter_token_latency_seconds"] == generated - sampled
    assert counts["vllm:time_per_output_token_seconds"] == generated - sampled
    assert counts["vllm:iteration_tokens_total"] == steps
    assert value(samples, "vllm:iteration_tokens_total_sum") >= prompt_tokens + generated - steps
    for name in HISTOGRAMS:
        buckets = [s for s in samples[f"{name}_bucket"] if s.labels["model_name"] == MODEL]
        values = [s.value for s in buckets]
        assert values == sorted(values), name
        assert buckets[-1].labels["le"] == "+Inf" and values[-1] == counts[name], name
    e2e_sum = value(samples, "vllm:e2e_request_latency_seconds_sum")
    queue_sum = value(samples, "vllm:request_queue_time_seconds_sum")
    inference_sum = value(samples, "vllm:request_inference_time_seconds_sum")
    assert 0 < queue_sum < e2e_sum and inference_sum <= e2e_sum - queue_sum
    # Ours are kept: the abort under its own reason, the finished ones under theirs.
    assert value_ours(samples, "kvcache_requests_total", finish_reason="abort") == 1
    assert value_ours(samples, "kvcache_requests_total", finish_reason="length") == 5


def value_ours(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    found = [s for s in samples[name] if labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels)
    return found[0].value


def test_an_idle_server_shows_every_series_at_zero(server: LiveServer) -> None:
    """Before any request: the series a dashboard plots exist (at 0), so its panels have data."""
    samples = scrape(server)
    for name in DASHBOARD_SERIES:
        assert name in samples, name
    for name in HISTOGRAMS:
        assert value(samples, f"{name}_count") == 0, name
    for reason in ("stop", "length", "abort"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0
