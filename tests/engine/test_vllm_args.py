"""`LLM(...)` takes what `kvcache serve` takes (issue 49, item 3): vLLM's dtype names, and vLLM's
arguments that EngineConfig has no field for, each honoured, accepted with one warning naming
it, or refused with a ValueError naming it (runner/engine/api/vllm_args.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.engine.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32")])
def test_vllms_dtype_names(given: str, dtype: str) -> None:
    assert EngineConfig(dtype=given).dtype == dtype


def test_float_is_float32(tiny_llama_tok_dir: Path) -> None:
    model = str(tiny_llama_tok_dir)
    by_alias = LLM(model, dtype="float", num_kv_blocks=32).generate(["Hello"], GREEDY)
    by_name = LLM(model, dtype="float32", num_kv_blocks=32).generate(["Hello"], GREEDY)
    assert by_alias[0].outputs[0].token_ids == by_name[0].outputs[0].token_ids


def test_vllms_arguments_that_change_nothing_here(
    tiny_llama_tok_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="runner.engine.api.vllm_args"):
        llm = LLM(
            str(tiny_llama_tok_dir),
            num_kv_blocks=32,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            quantization=None,
            disable_log_stats=True,
            tokenizer_mode="auto",
            swap_space=4,
            load_format="auto",
        )
    # one warning, for the one that means nothing here
    assert [r.getMessage().split("=")[0] for r in caplog.records] == ["swap_space"]
    assert "accepted and ignored" in caplog.text
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner.engine.api.vllm_args"):
        LLM(str(tiny_llama_tok_dir), num_kv_blocks=32, tokenizer_mode="mistral")
    assert "tokenizer_mode='mistral' is accepted and ignored" in caplog.text


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2: not available"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"quantization": "awq"}, "quantization='awq': not available here"),
        ({"tokenizer_mode": "custom"}, "tokenizer_mode='custom': must be one of"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8': no 8-bit KV cache"),
        ({"dtype": "float64"}, "dtype must be one of"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    tiny_llama_tok_dir: Path, option: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_tok_dir), **option)


def test_vllms_scheduling_policy_names_the_batching(tiny_llama_tok_dir: Path) -> None:
    """scheduling_policy="priority" is batching="priority"; "fcfs" leaves the batching given;
    another value, or a batching it cannot order, is refused by name before the model loads."""
    model = str(tiny_llama_tok_dir)
    assert LLM(model, scheduling_policy="priority").config.batching == "priority"
    # continuous batching is the default a command line passes: priority orders its queue
    priority = LLM(model, scheduling_policy="priority", batching="continuous")
    assert priority.config.batching == "priority"
    assert LLM(model, scheduling_policy="fcfs").config.batching == "continuous"
    assert LLM(model, scheduling_policy="fcfs", batching="static").config.batching == "static"
    with pytest.raises(ValueError, match="scheduling_policy='lifo': must be 'fcfs' or 'priority'"):
        LLM(model, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy='priority' and batching='static'"):
        LLM(model, scheduling_policy="priority", batching="static")
    with pytest.raises(ValueError, match="scheduling_policy='fcfs' and batching='priority'"):
        LLM(model, scheduling_policy="fcfs", batching="priority")
