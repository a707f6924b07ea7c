"""A KV pool asked for by size that the memory cannot hold is refused before it is allocated,
naming the option and both sizes, instead of `OSError: Cannot allocate memory` (issue 24,
item 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from kvcache import LLM


def test_the_api_names_the_option_and_the_sizes(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"num_kv_blocks .*1,000,000,000 blocks needs 7.5 TiB"):
        LLM(str(tiny_llama_dir), num_kv_blocks=10**9)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes: .* blocks fit"):
        LLM(str(tiny_llama_dir), kv_cache_memory_bytes=2**60)
    assert LLM(str(tiny_llama_dir), num_kv_blocks=64).kv.num_blocks == 64  # one that fits


def test_the_cli_names_the_flag(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--num-kv-blocks", "1000000000"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "--num-kv-blocks" in result.output and "7.5 TiB" in result.output
    assert "available" in result.output
