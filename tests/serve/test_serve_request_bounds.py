"""Bounds on what one request may ask of `kvcache serve`, each a 400 that names the field and
the limit: logit_bias entries, stop strings (how many, how long), stop_token_ids; a request
holding more samples (prompts x n) than the queue could ever take (not a 429 the client
would retry for ever); an empty prompt list; a number that is not finite (JSON's NaN)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from runner.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from tests.serve.conftest import LiveServer, ServeFactory

BASE = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def refused(resp: httpx.Response, param: str | None, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_field_sizes_past_their_bounds_are_400s(server: LiveServer) -> None:
    many = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    refused(post(server, {**BASE, "logit_bias": many}), "logit_bias", str(MAX_LOGIT_BIAS))
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    refused(post(server, {**BASE, "stop": stops}), "stop", str(MAX_STOP_STRINGS))
    long_stop = ["x" * (MAX_STOP_CHARS + 1)]
    refused(post(server, {**BASE, "stop": long_stop}), "stop", str(MAX_STOP_CHARS))
    ids = list(range(MAX_STOP_TOKEN_IDS + 1))
    refused(post(server, {**BASE, "stop_token_ids": ids}), "stop_token_ids", "1024")
    # Within the bounds the request runs (as many bias keys as the tiny model's vocabulary
    # holds: the engine refuses a token id past it).
    vocab = int(server.state.llm.hf_config.vocab_size)
    at_bound = {str(i): 0.5 for i in range(min(MAX_LOGIT_BIAS, vocab))}
    ok = post(server, {**BASE, "logit_bias": at_bound, "stop": stops[:MAX_STOP_STRINGS]})
    assert ok.status_code == 200, ok.text


def test_logit_bias_is_checked_in_linear_time() -> None:
    # The old check rebuilt a set of the keys seen for each key: 2,048 keys cost 2 million
    # steps. Its result is the same either way; a repeated token is still found.
    bias = {i: 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert len(SamplingParams(logit_bias=bias).bias_items) == MAX_LOGIT_BIAS
    with pytest.raises(ValueError, match="names token 7 twice"):
        SamplingParams(logit_bias={7: 1.0, "7": 2.0})  # type: ignore[dict-item]


def test_more_samples_than_the_queue_holds_is_a_400(serve: ServeFactory) -> None:
    with serve(max_queued_requests=8) as server:
        nine = {**BASE, "prompt": [f"p{i}" for i in range(9)]}
        refused(post(server, nine), "prompt", "9 samples", "at most 8")
        samples = {**BASE, "prompt": ["a", "b"], "n": 5}  # 2 prompts x 5 samples: 10
        refused(post(server, samples), "prompt", "10 samples", "at most 8")
        one_prompt = {**BASE, "n": 9, "temperature": 1.0}
        refused(post(server, one_prompt), "n", "9 samples", "at most 8")
        fits = post(server, {**BASE, "prompt": ["a", "b"], "n": 4, "temperature": 1.0})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 8


def test_an_empty_prompt_list_and_nan_are_400s(server: LiveServer) -> None:
    refused(post(server, {**BASE, "prompt": []}), "prompt", "at least one prompt")
    for raw in (b'"temperature": NaN', b'"top_p": Infinity', b'"logit_bias": {"5": NaN}'):
        body = b'{"model": "tiny", "prompt": "hi", ' + raw + b"}"
        resp = httpx.post(
            f"{server.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        assert "finite number" in resp.json()["error"]["message"], resp.text
