"""Tails through the engine (kvcache/partial_blocks.py keeps them): the next chat turn and a
request's later samples copy a partial last block instead of computing it again, with the same
greedy output as with the cache off."""

from __future__ import annotations

from pathlib import Path

from kvcache import LLM, SamplingParams


def test_next_chat_turn_computes_only_its_new_tokens(tiny_llama_dir: Path) -> None:
    """Turn 2's prompt is turn 1's prompt and answer plus new text: everything turn 1 computed
    (all but its last answer token) is served from the cache, the tail included, and greedy
    output equals an engine without the cache."""
    greedy = SamplingParams(max_tokens=9, temperature=0)
    llm = LLM(str(tiny_llama_dir), block_size=16)
    cold = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    first = [(i * 37) % 300 + 3 for i in range(27)]
    answer = llm.generate([first], greedy)[0].token_ids
    second = first + answer + [5, 6, 7, 8]
    out = llm.generate([second], greedy)[0]
    assert out.num_cached_tokens == len(first) + len(answer) - 1
    assert out.token_ids == cold.generate([second], greedy)[0].token_ids
    assert llm.block_manager.stats.copied_tokens > 0
    llm.block_manager.check_integrity()


def test_samples_of_one_prompt_copy_the_first_samples_partial_block(tiny_llama_dir: Path) -> None:
    """n=3: the first sample computes the prompt; the others find its full blocks cached and
    copy its partial block, computing only the last prompt token; answers are unchanged."""
    prompt = [(i * 53) % 300 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=3)
    llm = LLM(str(tiny_llama_dir), block_size=16)
    out = llm.generate([prompt], params)[0]
    stats = llm.stats()
    assert stats["copied_tokens"] == 2 * 7 and stats["hit_tokens"] == 2 * 39
    cold = LLM(str(tiny_llama_dir), enable_prefix_caching=False).generate([prompt], params)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in cold.outputs]
