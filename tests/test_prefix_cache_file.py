"""Warm starts: a prefix cache saved by one engine and loaded into another gives the same
greedy output as a cold run (and as transformers), serves the saved prefixes from the cache,
counts no hits for the loading itself, keeps the block manager sound when the pool is too small
for all of it, and refuses files saved for another model or layout, or damaged ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from cli import main
from kvcache import LLM, SamplingParams
from tests.test_engine_equivalence import hf_greedy, make_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def saved(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A cache file from one engine's run over prompts that share prefixes; its block count."""
    llm = LLM(str(tiny_llama_dir))
    llm.generate(make_prompts(320, seed=5), GREEDY)
    path = tmp_path_factory.mktemp("cache") / "prefix.safetensors"
    blocks = llm.save_prefix_cache(path)
    stats = llm.block_manager.stats
    assert stats.blocks_tails > 0  # partial last blocks are saved too
    assert blocks == stats.blocks_cached > 0
    return path, blocks


def test_warm_start_equals_cold_and_transformers(
    tiny_llama_dir: Path, saved: tuple[Path, int]
) -> None:
    path, blocks = saved
    prompts = make_prompts(320, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, 8, None) for p in prompts]
    warm = LLM(str(tiny_llama_dir))
    assert warm.load_prefix_cache(path) == blocks
    stats = warm.block_manager.stats
    assert stats.blocks_cached == blocks and stats.query_tokens == stats.hit_tokens == 0
    warm.block_manager.check_integrity()
    outs = warm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    # Every prompt finds its full blocks (all but the last token's) cached from the start, and
    # may copy a few slots more from a cached block that starts as its next block does.
    for o, p in zip(outs, prompts, strict=True):
        assert (len(p) - 1) // 16 * 16 <= o.num_cached_tokens < len(p)
    assert warm.block_manager.stats.query_tokens == sum(len(p) for p in prompts)
    warm.block_manager.check_integrity()


def test_loading_twice_adds_nothing(tiny_llama_dir: Path, saved: tuple[Path, int]) -> None:
    llm = LLM(str(tiny_llama_dir))
    assert llm.load_prefix_cache(saved[0]) == saved[1]
    assert llm.load_prefix_cache(saved[0]) == 0
    assert llm.block_manager.stats.blocks_cached == saved[1]


def test_a_small_pool_loads_what_fits(tiny_llama_dir: Path, saved: tuple[Path, int]) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=8)
    loaded = llm.load_prefix_cache(saved[0])
    assert 0 < loaded <= 8 < saved[1]  # what fits in free blocks
    llm.block_manager.check_integrity()
    prompts = make_prompts(320, seed=5)[:3]
    cold = LLM(str(tiny_llama_dir), num_kv_blocks=8).generate(prompts, GREEDY)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in cold]
    llm.block_manager.check_integrity()


def test_salted_prefixes_stay_salted(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompt = list(range(3, 3 + 40))
    llm = LLM(str(tiny_llama_dir))
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    path = tmp_path / "salted.safetensors"
    llm.save_prefix_cache(path)
    warm = LLM(str(tiny_llama_dir))
    warm.load_prefix_cache(path)
    assert warm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    # 2 full blocks and 7 of the tail's 8 slots, under the salt they were saved with.
    assert warm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 39


def test_an_empty_cache_round_trips(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    assert LLM(str(tiny_llama_dir)).save_prefix_cache(path) == 0
    assert LLM(str(tiny_llama_dir)).load_prefix_cache(path) == 0


def test_mismatched_or_damaged_files_are_refused(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, saved: tuple[Path, int], tmp_path: Path
) -> None:
    path = saved[0]
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a prefix cache file at all")
    cases = [
        (LLM(str(tiny_qwen2_dir)), path, "saved for fingerprint"),
        (LLM(str(tiny_llama_dir), block_size=8), path, "saved for block_size '16'"),
        (LLM(str(tiny_llama_dir), cpu_weight_dtype="int8"), path, "saved for weights"),
        (LLM(str(tiny_llama_dir)), garbage, "not a readable prefix cache file"),
        (LLM(str(tiny_llama_dir)), tmp_path / "missing.safetensors", "not a readable"),
        (LLM(str(tiny_llama_dir), enable_prefix_caching=False), path, "prefix cache is off"),
    ]
    for llm, bad, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.load_prefix_cache(bad)
        assert llm.block_manager.stats.blocks_cached == 0
        llm.block_manager.check_integrity()
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 8


def test_cli_keeps_a_prefix_cache_between_runs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    system = [3 + (i * 5) % 300 for i in range(48)]
    lines = [{"id": f"r{i}", "prompt_token_ids": system + [10 + i]} for i in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cache = tmp_path / "prefix.safetensors"
    records = []
    for run in range(2):
        out = tmp_path / f"out{run}.jsonl"
        args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
        result = CliRunner().invoke(main, [*args, "--max-tokens", "4", "--prefix-cache", cache])
        assert result.exit_code == 0, result.output
        assert f"saved to {cache}" in result.output
        records.append({r["id"]: r for r in map(json.loads, out.read_text().splitlines())})
    assert "loaded" in result.output
    assert records[0]["r0"]["cached_tokens"] == 0  # the first run starts cold
    assert records[1]["r0"]["cached_tokens"] == 48  # the second finds the system prompt
    assert {k: r["token_ids"] for k, r in records[0].items()} == {
        k: r["token_ids"] for k, r in records[1].items()
    }


def test_a_warm_start_has_the_tails(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A prompt that a saved request ended inside a block finds all but its last token cached
    in a warm engine, as it would in the engine that saved it, with the same tokens."""
    prompt = [3 + (i * 7) % 300 for i in range(37)]  # 2 full blocks and 5 tokens
    cold = LLM(str(tiny_llama_dir))
    first = cold.generate([prompt], GREEDY)[0]
    path = tmp_path / "tails.safetensors"
    assert cold.save_prefix_cache(path) == 3  # 2 full blocks and the tail
    warm = LLM(str(tiny_llama_dir))
    assert warm.load_prefix_cache(path) == 3
    assert warm.block_manager.stats.blocks_tails == 1
    warm.block_manager.check_integrity()
    again = warm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids
