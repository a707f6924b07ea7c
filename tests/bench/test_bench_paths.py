"""bench/ finds the checkout's files from its own place (a move of the package must move these
anchors too): the workloads in data/, the docs text weight_quality scores, the root that
pd_interference's worker processes import from, and the tools/ folder beside the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llama_cpp, pd_interference, vllm_cpu, weight_quality, workloads

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_anchors_its_paths_at_the_checkout() -> None:
    assert workloads.DATA_DIR == REPO / "data"
    assert workloads.workload_path("mixed_lengths").is_file()
    assert weight_quality.DOCS == REPO / "docs"
    assert pd_interference.ROOT == REPO
    assert (pd_interference.ROOT / "bench" / "pd_interference_worker.py").is_file()
    assert vllm_cpu.DEFAULT_PYTHON.is_relative_to(REPO.parent / "tools")
    assert vllm_cpu.DRIVER.is_file()
    assert llama_cpp.DEFAULT_SERVER.is_relative_to(REPO.parent / "tools")


def test_a_workload_of_text_needs_a_tokenizer(tmp_path: Path) -> None:
    """An engine without a tokenizer reads token-id workloads; a text line is a ValueError
    naming the line (it was an AttributeError on None)."""
    from bench.workloads import load_workload

    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 4}\n')
    [request] = load_workload(str(ids), None)
    assert (request.prompt_token_ids, request.max_tokens) == ([1, 2, 3], 4)
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt_token_ids": [1]}\n{"prompt": "Hello"}\n')
    with pytest.raises(ValueError, match="text.jsonl line 2: a text prompt needs a tokenizer"):
        load_workload(str(text), None)
