"""`kvcache serve` through the official openai client, sync and async, streaming and not:
greedy answers equal the engine's own, token for token; usage reports the prefix cache's hits;
/v1/models, /health and /metrics answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvcache import LLM, SamplingParams
from tests.serve.conftest import LiveServer

PROMPTS = ["The cache holds blocks of sixteen tokens each, ", "Hello", "x" * 40]
MAX_TOKENS = 20


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completions_equal_the_engine_token_for_token(
    server: LiveServer, reference_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    reference = reference_llm.generate(PROMPTS, params)
    api = client(server)
    whole = api.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    )
    assert [c.text for c in whole.choices] == [r.text for r in reference]
    assert whole.usage is not None
    assert whole.usage.completion_tokens == sum(len(r.token_ids) for r in reference)
    for choice, ref in zip(whole.choices, reference, strict=True):
        assert choice.logprobs is not None
        expected = [lp.logprob for lp in ref.logprobs or []]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    texts, logprobs = [""] * len(PROMPTS), [[] for _ in PROMPTS]
    usage = None
    for chunk in api.completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            logprobs[c.index] += c.logprobs.tokens if c.logprobs else []
    assert texts == [r.text for r in reference]
    tokens = [[reference_llm.tokenizer.decode([t]) for t in r.token_ids] for r in reference]
    assert logprobs == tokens  # token for token
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_sync_and_async_stream_equal_the_engine(
    server: LiveServer, reference_llm: LLM
) -> None:
    messages = [{"role": "user", "content": "Name three prime numbers."}]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = reference_llm.chat([messages], params)[0].text
    whole = client(server).chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )  # type: ignore[call-overload]
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason in ("stop", "length")

    async def streamed() -> tuple[str, list[str | None]]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        text, roles = "", []
        stream = await api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )  # type: ignore[call-overload]
        async for chunk in stream:
            for c in chunk.choices:
                roles.append(c.delta.role)
                text += c.delta.content or ""
        await api.close()
        return text, roles

    text, roles = asyncio.run(streamed())
    assert text == expected
    assert roles[0] == "assistant"


def test_a_repeated_request_reports_cached_tokens(server: LiveServer) -> None:
    api = client(server)
    prompt = "A prompt long enough to fill two blocks of the cache: " * 2
    first = api.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    second = api.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens >= 2 * 16
    assert second.choices[0].text == first.choices[0].text


def test_samples_models_health_and_metrics(server: LiveServer) -> None:
    api = client(server)
    out = api.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    models = api.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    info = httpx.get(f"{server.url}/kvcache/info").json()
    assert info["block_size"] == 16 and info["fingerprint"] == server.state.llm.fingerprint
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "kvcache_requests_running",
        "kvcache_requests_waiting",
        "kvcache_prompt_tokens_total",
        "kvcache_cached_tokens_total",
        "kvcache_generation_tokens_total",
        "kvcache_prefix_cache_hit_rate",
        "kvcache_kv_blocks_in_use",
        "kvcache_time_to_first_token_seconds_bucket",
        "kvcache_inter_token_latency_seconds_bucket",
    ):
        assert name in metrics, name


def test_response_format_and_chat_logprobs(server: LiveServer) -> None:
    api = client(server)
    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    out = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=10,
        temperature=0,
        response_format=fmt,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert json.loads(choice.message.content or "") in ("yes", "no")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert out.usage is not None and len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
