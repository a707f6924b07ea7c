"""`kvcache bench-serve` as `vllm bench serve` is used: against a server that wants an API key
(sent as a bearer token), on the chat and the completions endpoints, with the time per output
token and vLLM's result keys in its JSON beside ours; no key, or an empty one, is a clear
error."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from bench.serve.workload import as_messages, as_prompt, read_lines
from cli import main
from tests.serve.conftest import LiveServer, ServeFactory

REPO = Path(__file__).resolve().parents[2]
KEY = "bench-key"
DATASET = REPO / "data/sample.jsonl"
VLLM_KEYS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    *(
        f"{stat}_{name}_ms"
        for stat in ("mean", "median", "std", "p99")
        for name in ("ttft", "tpot", "itl", "e2el")
    ),  # fmt: skip
]


@pytest.fixture
def keyed_server(serve: ServeFactory) -> Iterator[LiveServer]:
    with serve(api_key=KEY) as server:
        yield server


def bench(server: LiveServer, tmp_path: Path, *more: str) -> tuple[Any, dict[str, Any]]:
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", server.url, "--dataset", str(DATASET)]
    args += ["--max-concurrency", "2", "--ignore-eos", "--result-json", str(out), *more]
    result = CliRunner(env={"KVCACHE_API_KEY": None}).invoke(main, args)  # only the flag's key
    return result, json.loads(out.read_text()) if out.exists() else {}


def test_completions_with_a_key_report_tpot_under_vllm_names(
    keyed_server: LiveServer, tmp_path: Path
) -> None:
    more = ["--api-key", KEY, "--endpoint", "/v1/completions", "--workload", "dataset"]
    result, summary = bench(
        keyed_server, tmp_path, *more, "--num-prompts", "4", "--max-tokens", "6"
    )
    assert result.exit_code == 0, result.output
    assert "Median TPOT (ms):" in result.output
    missing = [key for key in VLLM_KEYS if key not in summary]
    assert not missing, missing
    assert summary["completed"] == summary["successful"] == 4, summary["errors"]
    assert summary["backend"] == "openai" and summary["endpoint"] == "/v1/completions"
    assert summary["output_lens"] == [6] * 4 and summary["total_output_tokens"] == 24
    # Each request's TPOT is its time after the first token over the 5 tokens after it.
    pairs = zip(summary["latencies"], summary["ttfts"], strict=True)
    tpots = [(e2e - ttft) / 5 * 1000 for e2e, ttft in pairs]
    assert summary["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots))
    assert summary["mean_tpot_ms"] > 0 and summary["median_ttft_ms"] == summary["p50_ttft_ms"]
    tokens = summary["total_input_tokens"] + summary["total_output_tokens"]
    assert summary["total_token_throughput"] == pytest.approx(tokens / summary["duration"])
    assert summary["mean_e2el_ms"] == summary["mean_e2e_ms"]
    # What was sent is the line's conversation as one prompt, on the completions route.
    prompt = as_prompt(as_messages(read_lines(DATASET)[0]))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEY}"}
    resp = httpx.post(f"{keyed_server.url}/v1/completions", json=body, headers=headers)
    assert summary["input_lens"][0] == resp.json()["usage"]["prompt_tokens"]


def test_chat_turns_with_a_key(keyed_server: LiveServer, tmp_path: Path) -> None:
    more = ["--api-key", KEY, "--num-prompts", "2", "--turns", "2", "--max-tokens", "4"]
    more += ["--no-system-prompt", "--follow-up-chars", "0"]
    result, summary = bench(keyed_server, tmp_path, *more)
    assert result.exit_code == 0, result.output
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["backend"] == "openai-chat" and summary["mean_tpot_ms"] > 0


def test_the_key_from_the_environment(keyed_server: LiveServer, tmp_path: Path) -> None:
    """As `kvcache serve` reads its key: $KVCACHE_API_KEY, so it stays out of `ps`."""
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", keyed_server.url, "--dataset", str(DATASET)]
    args += ["--workload", "dataset", "--num-prompts", "2", "--max-tokens", "2"]
    result = CliRunner(env={"KVCACHE_API_KEY": KEY}).invoke(
        main, [*args, "--result-json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["completed"] == 2


def test_no_key_or_an_empty_one_is_refused(keyed_server: LiveServer, tmp_path: Path) -> None:
    result, _ = bench(keyed_server, tmp_path)
    assert result.exit_code != 0 and "HTTP 401" in result.output, result.output
    result, _ = bench(keyed_server, tmp_path, "--api-key", "")
    assert result.exit_code == 2 and "--api-key is empty" in result.output, result.output
