"""Isolation of cached KV: across cache salts, across models, and across prefixes whose block
hashes collide. A wrong reuse never raises; it only changes outputs, so every test compares the
tokens generated with what an engine without sharing produces."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvcache.hashing
import kvcache.radix_tree
from kvcache import LLM, SamplingParams, block_hashes, namespace_root
from kvcache.radix_tree import InsertResult, RadixTree

GREEDY = SamplingParams(max_tokens=3, temperature=0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


# ------------------------------------------------------------------------------ cache salt
def test_cache_salt_hits_within_a_salt_and_never_across(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=16)
    prompt = tokens(1, 40)  # two full blocks and a tail
    first = llm.generate([prompt], GREEDY, cache_salt="alice")[0]
    assert first.num_cached_tokens == 0
    # The two full blocks, and 7 of the tail's 8 slots (the first run's tail, copied).
    assert llm.generate([prompt], GREEDY, cache_salt="alice")[0].num_cached_tokens == 39
    # Each other salt (None and "" are different salts; so is a near-miss string) starts cold.
    for salt in ("bob", None, "", "alice ", "Alice"):
        out = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
        assert out.num_cached_tokens == 0, f"salt {salt!r} reused another salt's blocks"
        assert out.token_ids == first.token_ids
    for salt in ("bob", None, ""):  # ... and then hits its own blocks
        assert llm.generate([prompt], GREEDY, cache_salt=salt)[0].num_cached_tokens == 39
    llm.block_manager.check_integrity()


def test_running_requests_of_two_salts_hold_disjoint_blocks(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=16)
    prompt = tokens(2, 40)
    for salt in ("alice", "bob"):
        llm.generate([prompt], GREEDY, cache_salt=salt)  # warm both namespaces
    seqs = {
        (salt, i): llm.add_request(prompt, GREEDY, cache_salt=salt)
        for salt in ("alice", "bob")
        for i in range(2)
    }
    llm.step()  # admits all four
    bm = llm.block_manager
    tables = {key: bm.block_table(seq.seq_id) for key, seq in seqs.items()}
    assert all(seq.num_cached_tokens == 39 for seq in seqs.values())
    for salt in ("alice", "bob"):  # within a salt the full blocks are one set of blocks...
        assert tables[(salt, 0)][:2] == tables[(salt, 1)][:2]
        assert tables[(salt, 0)][2] != tables[(salt, 1)][2]  # ... each copies the tail
    alice = set(tables[("alice", 0)] + tables[("alice", 1)])
    bob = set(tables[("bob", 0)] + tables[("bob", 1)])
    assert not alice & bob, "requests of different salts share KV blocks"
    assert seqs[("alice", 0)].root != seqs[("bob", 0)].root
    llm.run_until_done()
    bm.check_integrity()
    assert bm.stats.blocks_in_use == 0


# ------------------------------------------------------------------------------ models
def _with_other_weights(src: Path, dst: Path) -> Path:
    """Copy a model folder, then replace every weight by another of the same shape and dtype
    (so config.json and the file size stay identical)."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(123)
    other = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.1 for k, v in state.items()}
    save_file(other, str(weights), metadata={"format": "pt"})
    return dst


def test_same_folder_same_fingerprint_and_root(tiny_llama_dir: Path) -> None:
    a, b = LLM(str(tiny_llama_dir)), LLM(str(tiny_llama_dir))
    assert a.fingerprint == b.fingerprint
    assert a._root(None) == b._root(None) and a._root("s") == b._root("s")


def test_other_architecture_size_has_another_namespace(
    tiny_llama_dir: Path, make_tiny_model: Callable[..., Path]
) -> None:
    two, three = LLM(str(tiny_llama_dir)), LLM(str(make_tiny_model("llama", num_hidden_layers=3)))
    assert two.fingerprint != three.fingerprint
    for salt in (None, "", "tenant"):
        assert two._root(salt) != three._root(salt)
    prompt = tokens(3, 40)
    assert block_hashes(prompt, 16, two._root(None)) != block_hashes(prompt, 16, three._root(None))
    assert not set(block_hashes(prompt, 16, two._root(None))) & set(
        block_hashes(prompt, 16, three._root(None))
    )


def test_identical_config_other_weights_has_another_namespace(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    a = shutil.copytree(tiny_llama_dir, tmp_path / "a")
    b = _with_other_weights(tiny_llama_dir, tmp_path / "b")
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    llm_a, llm_b = LLM(str(a)), LLM(str(b))
    assert llm_a.fingerprint != llm_b.fingerprint
    assert namespace_root(llm_a.fingerprint) != namespace_root(llm_b.fingerprint)
    prompt = tokens(4, 20)
    # The weights really differ (else the check above would prove nothing about weights) ...
    out_a = llm_a.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    out_b = llm_b.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out_a.token_ids != out_b.token_ids
    # ... and a copy of the same weights is a separate namespace too (a miss, never a reuse).
    assert LLM(str(a)).fingerprint == llm_a.fingerprint
    assert llm_a.fingerprint != LLM(str(tiny_llama_dir)).fingerprint


def test_weights_rewritten_in_place_change_the_fingerprint(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    before = LLM(str(folder)).fingerprint
    shutil.rmtree(folder)
    _with_other_weights(tiny_llama_dir, folder)
    assert LLM(str(folder)).fingerprint != before


# ------------------------------------------------------------------------------ collisions
def _collision_prompts() -> list[list[int]]:
    """Prompts of 4-token blocks that share first blocks, differ later, reuse the same block
    content under different parents, and repeat exactly."""
    a, b, c, d, e = (tokens(10 + i, 4) for i in range(5))
    prompts = [
        a + b + c + [7, 8],
        a + b + d + [9],
        a + c + b + [5, 5, 5],
        b + a + c + [11],
        c + c + c + c + [12],
        a + b + c + d + e + [13],
        e + [14, 15],
        tokens(20, 23),
        a + b + c + [7, 8],  # exact repeat of the first
        tokens(21, 9),
    ]
    return prompts + [p + tokens(30 + i, 3) for i, p in enumerate(prompts[:5])]


@pytest.fixture(scope="module")
def collision_refs(tiny_llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), block_size=4, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(_collision_prompts(), GREEDY)]


@pytest.mark.parametrize("pool", [None, 12], ids=["big-pool", "12-block-pool"])
@pytest.mark.parametrize("target", ["block-hash", "xxh3"])
def test_constant_hash_outputs_equal_cache_off(
    tiny_llama_dir: Path,
    collision_refs: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    pool: int | None,
) -> None:
    """Every block hash is the same constant, so every lookup past the first block of a
    namespace is a hash hit; only the token (and parent) comparison keeps wrong KV out.
    'block-hash' patches the chained block hash where the tree and `block_hashes` use it;
    'xxh3' patches xxhash itself, so namespace roots collide as well. The 12-block pool adds
    eviction: a collided block stays private and is retried once the other is evicted."""
    const = 0x5EED_5EED

    def constant_block(parent: int, block: bytes) -> int:
        return const

    if target == "block-hash":
        monkeypatch.setattr(kvcache.hashing, "hash_packed_block", constant_block)
        monkeypatch.setattr(kvcache.radix_tree, "hash_packed_block", constant_block)
    else:
        monkeypatch.setattr(kvcache.hashing, "xxh3_64_intdigest", lambda data, seed=0: const)
    assert set(block_hashes(tokens(0, 12), 4, 1)) == {const}  # the patch reaches the engine

    collisions = 0
    real_insert = RadixTree.insert

    def counting_insert(self: RadixTree, *args: Any, **kwargs: Any) -> InsertResult:
        nonlocal collisions
        result = real_insert(self, *args, **kwargs)
        collisions += result.collided
        return result

    monkeypatch.setattr(RadixTree, "insert", counting_insert)
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=pool)
    prompts = _collision_prompts()
    for attempt in ("cold", "warm"):
        seqs = [llm.add_request(p, GREEDY) for p in prompts]
        steps = 0
        while llm.has_unfinished():
            llm.step()
            llm.block_manager.check_integrity()
            steps += 1
            assert steps < 500
        assert [s.output_token_ids for s in seqs] == collision_refs, f"{attempt} pass differs"
        if attempt == "warm":  # true hits are still taken: the repeats reuse their blocks
            assert sum(s.num_cached_tokens for s in seqs) > 0
    assert collisions > 0, "the workload never collided; the test proves nothing"
    stats = llm.block_manager.stats
    assert stats.blocks_in_use == 0
    if pool is not None:
        assert stats.evicted_blocks > 0
