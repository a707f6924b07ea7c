"""A text prompt that could never fit the context is refused by its bytes, before any
tokenizer runs: before, the engine's thread tokenized it whole (seconds for megabytes, every
stream waiting) and then refused it by its token count. A prompt that could fit is never
refused so: the bound is SHRINK_MARGIN times the longest token's bytes per context token."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from runner.model.loader import load_tokenizer, read_config
from runner.sampling.prompt_bytes import (
    SHRINK_MARGIN,
    longest_token_bytes,
    max_prompt_bytes,
)
from tests.serve.conftest import LiveServer


def test_the_bound_holds_every_prompt_that_fits(tiny_llama_tok_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_tok_dir, read_config(tiny_llama_tok_dir))
    longest = longest_token_bytes(tokenizer)
    assert longest == max(len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer)))
    assert max_prompt_bytes(tokenizer, 512) == SHRINK_MARGIN * longest * 512
    for text in ("hello world " * 40, "é" * 300, "日本語のテキスト" * 30, "</s><s>" * 50):
        tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert tokens * longest >= len(text.encode()), text[:20]  # never fewer tokens


def test_a_prompt_past_the_bound_is_refused_at_once(server: LiveServer) -> None:
    limit = server.state.engine.max_prompt_bytes
    prompt = "hello world " * 250_000  # 3 MB: seconds of tokenizing on the engine's thread
    start = time.monotonic()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    took = time.monotonic() - start
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == "prompt", error
    assert f"no text over {limit} bytes" in error["message"], error
    assert took < 2.0, took  # 4-5 s before, the whole prompt tokenized first
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * limit}]}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
    ok = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "hi"}, timeout=60)
    assert ok.status_code == 200, ok.text
