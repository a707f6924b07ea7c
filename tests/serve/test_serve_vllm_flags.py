"""`vllm serve`'s common flags on `kvcache serve` (issue 49, item 4): a vLLM command line starts
the server, each flag doing what vLLM's does or accepted as docs/SERVE.md says; a flag whose
value cannot be honoured is a usage error naming it, before any model loads."""

from __future__ import annotations

import signal
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from runner.serve.command import serve
from tests.redis_server import free_port
from tests.serve.processes import serve_process, wait_until_up


def test_a_vllm_command_line_serves(tiny_llama_tok_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = str(tiny_llama_tok_dir)
    command = [model, "--port", str(port)]
    command += ["--served-model-name", "tiny", "other", "--num-kv-blocks", "64"]
    command += ["--enable-chunked-prefill", "--swap-space", "4", "--tokenizer", model]
    command += ["--uvicorn-log-level", "info", "--disable-uvicorn-access-log"]
    command += ["--max-logprobs", "20", "--generation-config", "vllm"]
    command += ["--chat-template-content-format", "string", "--max-model-len", "0.4k"]
    command += ["--kv-cache-dtype", "auto", "-tp", "1", "--disable-log-stats"]
    command += ["--scheduling-policy", "priority"]
    proc = serve_process(command)
    try:
        wait_until_up(proc, url)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        cards = api.models.list().data
        assert [c.id for c in cards] == ["tiny", "other"]
        assert cards[0].model_dump()["max_model_len"] == 400  # 0.4k, as vLLM reads it
        reply = api.chat.completions.create(
            model="other",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            extra_body={"priority": 1},
        )
        assert reply.model == "tiny" and reply.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "swap_space=4.0 is accepted and ignored" in err
    assert "Uvicorn running" in err  # info level, as asked
    assert "POST /v1/chat/completions" not in err  # and no access lines


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-dtype", "fp8"], "no 8-bit KV cache"),
        (["--max-logprobs", "5"], "cap is 20"),
        (["--generation-config", "auto"], "generation_config.json is not read"),
        (["--reasoning-parser", "deepseek_r1"], "reasoning is not split out"),
        (["--chat-template-content-format", "openai"], "joined into one string"),
        (["--max-model-len", "1.5K"], "whole number"),
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["a", "b"], "unexpected extra arguments: b"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(serve, flags)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_quantization_is_refused_by_name(tiny_llama_tok_dir: Path) -> None:
    result = CliRunner().invoke(serve, [str(tiny_llama_tok_dir), "--quantization", "awq"])
    assert result.exit_code == 1, result.output
    assert "quantization='awq': not available here" in result.output
