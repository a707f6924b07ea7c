"""The host tier's write-back: the blocks one allocation evicts go down in one copy off the
pool, and a block the host tier holds already (loaded from it, evicted again) is not copied
or written again; the answers stay those of the prefix cache off, token for token."""

from __future__ import annotations

import random
from pathlib import Path

from kvcache import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
POOL = 12  # blocks of 16: two 69-token prompts at a time, a third of the six system prompts


def rounds(count: int) -> list[list[int]]:
    """Six 64-token system prompts (4 blocks each), ``count`` rounds of one question each:
    every round finds its system prompts evicted by the round before."""
    rng = random.Random(3)
    systems = [[rng.randrange(3, 300) for _ in range(64)] for _ in range(6)]
    return [s + [rng.randrange(3, 300) for _ in range(5)] for _ in range(count) for s in systems]


def test_a_block_is_written_back_once(tiny_llama_dir: Path) -> None:
    prompts = rounds(3)
    reference = LLM(str(tiny_llama_dir), enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, host_cache_bytes=2**24)
    outs = []
    for prompt in prompts:  # one at a time, each one's writes landed before the next
        outs += llm.generate([prompt], GREEDY)
        llm.flush_cache_tiers()
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.num_cached_tokens for o in outs] == [0] * 6 + [64] * 12
    stats = llm.stats()
    host = stats["cache_tiers"]["tiers"]["host"]
    assert host["hit_blocks"] == 12 * 4
    # Rounds 2 and 3 evict the blocks they loaded from the host tier: never written again.
    assert stats["evicted_blocks"] > 2 * 6 * 4
    assert host["written_blocks"] == host["written_values"] == 6 * 4
    assert stats["cache_tiers"]["dropped_writes"] == 0
    llm.block_manager.check_integrity()
