"""The engine over its tiers: greedy output with every tier combination equals the output with
the prefix cache off, token for token, while a pool too small for the working set evicts blocks
and gets them back from the tiers; a restart on the same disk directory and a second engine on
the same Redis server get the first one's prefixes as hits; Redis killed in the middle of a
batch changes no answer; a tenant's cache_salt keeps its blocks apart in every tier."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvcache import LLM, SamplingParams
from tests.redis_server import RedisServer

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
POOL = 12  # blocks of 16: two 69-token prompts at a time, a third of the six system prompts


def workload(seed: int = 0) -> list[list[int]]:
    """Six 64-token system prompts, two questions each: the second round of questions finds
    its system prompt evicted from a pool of POOL blocks."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(64)] for _ in range(6)]
    return [s + [rng.randrange(3, 300) for _ in range(5)] for _ in range(2) for s in systems]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(workload(), GREEDY)]


def one_by_one(llm: LLM, prompts: list[list[int]], **kwargs: Any) -> list[Any]:
    """Each prompt alone, the tiers' writes landed before the next (so the test is exact)."""
    outs = []
    for prompt in prompts:
        outs += llm.generate([prompt], GREEDY, **kwargs)
        if llm.tiers is not None:
            llm.tiers.flush()
    return outs


# Chunks of 3 blocks: each system prompt goes down as one chunk and one single block (its last).
@pytest.mark.parametrize(
    ("tiers", "chunk"),
    [("host", 48), ("disk", 48), ("remote", 48), ("host+disk+remote", 48), ("disk+remote", 16)],
)
def test_every_tier_combination_equals_no_cache(
    tiny_llama_dir: Path,
    reference: list[list[int]],
    tmp_path: Path,
    redis_server: RedisServer,
    tiers: str,
    chunk: int,
) -> None:
    options: dict[str, Any] = {"cache_chunk_tokens": chunk}
    if "host" in tiers:
        options["host_cache_bytes"] = 2**24
    if "disk" in tiers:
        options["disk_cache_dir"] = str(tmp_path / "disk")
    if "remote" in tiers:
        options["remote_cache_url"] = redis_server.url
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, **options)
    outs = one_by_one(llm, workload())
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [0] * 6 + [64] * 6  # round 2: from the tiers
    stats = llm.stats()
    per_tier = stats["cache_tiers"]["tiers"]
    assert sum(t["hit_tokens"] for t in per_tier.values()) == 6 * 64
    assert stats["evicted_blocks"] > 0 and stats["cache_tiers"]["dropped_writes"] == 0
    assert all(t["errors"] == 0 and t["rejected_blocks"] == 0 for t in per_tier.values())
    for name in ("disk", "remote"):  # 4 blocks a system prompt: a chunk of 3 and 1, or 4 of 1
        if name in per_tier:
            assert per_tier[name]["written_blocks"] == 6 * 4
            assert per_tier[name]["written_values"] == 6 * (2 if chunk == 48 else 4)
    llm.block_manager.check_integrity()
    # A whole batch at once (admission order, preemption, eviction mid-batch): same answers.
    batch = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, **options).generate(workload(), GREEDY)
    assert [o.token_ids for o in batch] == reference


def test_a_restart_on_the_same_disk_gets_hits(
    tiny_llama_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    first = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path))
    first.generate(workload()[:6], GREEDY)
    first.tiers.close()  # type: ignore[union-attr]  # what a process does at exit
    second = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path))
    outs = second.generate(workload()[6:], GREEDY)
    assert [o.token_ids for o in outs] == reference[6:]
    assert [o.num_cached_tokens for o in outs] == [64] * 6
    assert second.stats()["cache_tiers"]["tiers"]["disk"]["hit_blocks"] == 24


def test_two_engines_share_one_redis(
    tiny_llama_dir: Path, reference: list[list[int]], redis_server: RedisServer
) -> None:
    first = LLM(str(tiny_llama_dir), remote_cache_url=redis_server.url, cache_key="shared")
    first.generate(workload()[:6], GREEDY)
    first.tiers.flush()  # type: ignore[union-attr]
    second = LLM(str(tiny_llama_dir), remote_cache_url=redis_server.url, cache_key="shared")
    outs = second.generate(workload()[6:], GREEDY)
    assert [o.token_ids for o in outs] == reference[6:]
    assert [o.num_cached_tokens for o in outs] == [64] * 6
    # The loaded blocks entered the device tree: the next request hits on the device.
    again = second.generate(workload()[6:7], GREEDY)[0]
    assert again.num_cached_tokens >= 64 and again.token_ids == reference[6]
    assert second.stats()["cache_tiers"]["tiers"]["remote"]["hit_blocks"] == 24


def test_redis_killed_mid_batch_changes_no_answer(
    tiny_llama_dir: Path, reference: list[list[int]], redis_server: RedisServer
) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=POOL, remote_cache_url=redis_server.url)
    for prompt in workload():
        llm.add_request(prompt, GREEDY)
    done = []
    for _ in range(3):
        done += llm.step()
    redis_server.stop()
    done += llm.run_until_done()
    by_prompt = {tuple(o.prompt_token_ids): o.token_ids for o in done}
    assert [by_prompt[tuple(p)] for p in workload()] == reference
    remote = llm.stats()["cache_tiers"]["tiers"]["remote"]
    assert remote["errors"] >= 1


def test_a_cache_salt_keeps_tenants_apart_in_the_tiers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    prompt = workload()[0]
    first = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path))
    first.generate([prompt], GREEDY, cache_salt="tenant-a")
    first.tiers.flush()  # type: ignore[union-attr]
    second = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path))
    assert second.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert second.generate([prompt], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert second.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 64


def test_tier_options_are_checked(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHE_CACHE_KEY", raising=False)
    with pytest.raises(ValueError, match="require_cache_mac needs cache_key"):
        LLM(str(tiny_llama_dir), require_cache_mac=True)
    with pytest.raises(ValueError, match="prefix cache on"):
        LLM(str(tiny_llama_dir), host_cache_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="remote_cache_url"):
        LLM(str(tiny_llama_dir), remote_cache_url="http://localhost:6379")
    with pytest.raises(ValueError, match="cache_chunk_tokens must be a positive multiple"):
        LLM(str(tiny_llama_dir), cache_chunk_tokens=24)
    monkeypatch.setenv("KVCACHE_CACHE_KEY", "from-the-environment")
    assert LLM(str(tiny_llama_dir), require_cache_mac=True).cache_mac_key == b"from-the-environment"


def test_a_waiting_request_is_prefetched_into_the_host_tier(
    tiny_llama_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    first = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path))
    first.generate(workload()[:2], GREEDY)
    first.flush_cache_tiers()
    second = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path), host_cache_bytes=2**24)
    for prompt in workload()[6:8]:
        second.add_request(prompt, GREEDY)
    second.flush_cache_tiers()  # the prefetch has read both chains up before any step
    outs = sorted(second.run_until_done(), key=lambda o: int(o.request_id))
    assert [o.token_ids for o in outs] == reference[6:8]
    stats = second.stats()["cache_tiers"]
    assert stats["prefetched_blocks"] == 8
    assert stats["tiers"]["host"]["hit_blocks"] == 8 and stats["tiers"]["disk"]["hit_blocks"] == 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_other_architectures_through_host_and_disk(
    make_tiny_model: Any, tmp_path: Path, arch: str
) -> None:
    """Another head size, and a model whose local layers attend to a window of 16 tokens."""
    model = str(make_tiny_model(arch))
    prompts = workload(seed=1)
    expected = [
        o.token_ids for o in LLM(model, enable_prefix_caching=False).generate(prompts, GREEDY)
    ]
    llm = LLM(model, num_kv_blocks=POOL, host_cache_bytes=2**22, disk_cache_dir=str(tmp_path))
    outs = one_by_one(llm, prompts)
    assert [o.token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs][6:] == [64] * 6
