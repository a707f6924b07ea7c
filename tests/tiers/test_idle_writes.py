"""Blocks committed past the tier writer's queue wait in the pool for room. They used to go
down only at the next commit or eviction: an idle server never wrote them, and a Python user
had to call flush_cache_tiers() or lose them at exit. Now closing the tiers (at exit, or
when the engine is collected) writes them all first; an idle server's engine thread queues
them as room frees (tests/serve/test_serve_idle_writes.py)."""

from __future__ import annotations

from pathlib import Path

from kvcache import LLM, SamplingParams

# Blocks of one token: a 320-token prompt is one commit of 320 blocks, past the write queue's
# 256, so 64 wait (as in test_long_commit.py).
ONE_STEP = {"block_size": 1, "max_num_batched_tokens": 512, "enable_chunked_prefill": False}
PROMPT = [3 + (i * 7) % 290 for i in range(320)]
ONE = SamplingParams(max_tokens=1, temperature=0)


def cached_from_disk(model: str, disk: str) -> int:
    fresh = LLM(model, disk_cache_dir=disk, **ONE_STEP)  # a restart: only the disk shared
    return fresh.generate([PROMPT], ONE)[0].num_cached_tokens


def test_waiting_blocks_land_when_the_tiers_close(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model, disk = str(tiny_llama_dir), str(tmp_path / "disk")
    writer = LLM(model, disk_cache_dir=disk, **ONE_STEP)
    writer.generate([PROMPT], ONE)
    assert writer.stats()["cache_tiers"]["waiting_writes"] > 0  # the case under test
    assert writer.tiers is not None
    writer.tiers.close()  # what exit, or the engine's collection, runs
    assert cached_from_disk(model, disk) == len(PROMPT) - 1  # every block but the last token's
