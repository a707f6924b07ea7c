"""The tiers' copies off the pool at commit and eviction never wait for the device: on a GPU
each is queued behind the step in flight and its bytes are waited for by the tiers' writer
thread (runner/engine/kv/transfer.py's ``PoolCopies``; kvcache/tiers' ``DeferredBytes``).

On the CPU a device of the test's own (``GatedCopies``) stands in for the GPU's stream: a
copy's host buffer holds garbage until the test opens the gate, then the bytes its block held
when it was queued (the plain loop writes nothing in between: as a stream's order). Shown: a
commit or an eviction returns with every copy still open; the tiers get the right bytes once
they complete; a load racing a write still open waits for it and hits; a copy that fails is a
miss, never other K/V; no blocking copy is left at commit or eviction (13 before, on this
workload). A CUDA test runs the real thing, overlapped."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.hashing import hash_packed_block, pack_tokens
from kvcache.tiers import BlockSpec, BlockValue, HostTier, TieredStore, decode
from kvcache.tiers.writer import Pending
from runner.engine.kv import transfer as kv_transfer
from runner.engine.kv.transfer import CopyDone
from runner.kv_pool.store import KVStore

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
POOL = 12  # blocks of 16: each round of six 69-token prompts evicts the round before's
BLOCKING_BEFORE = 13  # read_blocks calls at commit and eviction in the count's workload
GATE_S = 30.0  # a copy never completes by itself: a test that forgets its gate fails


def rounds(count: int) -> list[list[int]]:
    """Six 64-token system prompts (4 blocks each), ``count`` rounds of one question each:
    every round finds its system prompts evicted by the round before."""
    rng = random.Random(3)
    systems = [[rng.randrange(3, 300) for _ in range(64)] for _ in range(6)]
    return [s + [rng.randrange(3, 300) for _ in range(5)] for _ in range(count) for s in systems]


class _Gated:
    """The point one copy completes at: when the gate opens (then the bytes land)."""

    def __init__(self, copies: GatedCopies, host: torch.Tensor, snapshot: torch.Tensor) -> None:
        self.copies, self.host, self.snapshot = copies, host, snapshot

    def synchronize(self) -> None:
        self.copies.waits.append(threading.get_ident())
        if not self.copies.gate.wait(GATE_S):
            raise TimeoutError("the test never completed the copy")
        if self.copies.fail:
            raise RuntimeError("the device failed the copy")
        self.host.copy_(self.snapshot)


class GatedCopies:
    """A device whose copies complete when the test opens ``gate`` (all at once); with
    ``fail``, every copy fails then. Records each wait's thread."""

    def __init__(self, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.fail = fail
        self.queued = 0  # copies queued
        self.waits: list[int] = []  # the thread of each wait for a copy

    def queue(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        self.queued += 1
        host = torch.empty_like(source)
        host.view(torch.uint8).fill_(0xFF)  # NaN until the copy completes: read early, wrong
        return host, _Gated(self, host, source.clone())


def tiered(path: Path, copies: GatedCopies | None = None, **options: Any) -> LLM:
    """An engine with a host tier (unless ``options`` say otherwise) in a small pool, its
    copies on ``copies`` (else the CPU's own: bytes at once)."""
    llm = LLM(str(path), **{"num_kv_blocks": POOL, "host_cache_bytes": 2**24, **options})
    assert llm.tiers is not None and llm.tiers.pool.copies is None  # the CPU: no deferral
    llm.tiers.pool.copies = copies
    return llm


def host_values(llm: LLM) -> dict[str, bytes]:
    assert llm.tiers is not None and llm.tiers.host is not None
    host = llm.tiers.host
    return dict(zip(host.keys(), host.get_many(host.keys()), strict=True))


def one_at_a_time(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return [out for prompt in prompts for out in llm.generate([prompt], GREEDY)]


def count_blocking_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The blocks of each copy made at once (``read_blocks``, a blocking copy on a GPU), from
    now on in this test."""
    blocking: list[int] = []
    read_blocks = kv_transfer.read_blocks

    def counted(kv: KVStore, block_ids: Sequence[int]) -> list[bytes]:
        blocking.append(len(block_ids))
        return read_blocks(kv, block_ids)

    monkeypatch.setattr(kv_transfer, "read_blocks", counted)
    return blocking


def test_evictions_return_before_their_copies_and_the_tier_gets_their_bytes(
    tiny_llama_dir: Path,
) -> None:
    """(a) Six prompts, each evicting the blocks of the one before, run while no copy ever
    completes: no write reaches the host tier, and the engine's thread waited for none.
    (b) Once they complete, the host tier holds exactly what the same engine with copies
    made at once holds, value for value."""
    prompts = rounds(1)
    immediate = tiered(tiny_llama_dir)
    one_at_a_time(immediate, prompts)
    immediate.flush_cache_tiers()
    expected = host_values(immediate)
    assert len(expected) >= 3 * 4  # the first prompts' system blocks were evicted

    copies = GatedCopies()
    llm = tiered(tiny_llama_dir, copies)
    one_at_a_time(llm, prompts)
    assert not copies.gate.is_set() and copies.queued >= 4
    assert host_values(llm) == {}  # every write is waiting for its copy
    copies.gate.set()
    llm.flush_cache_tiers()
    assert host_values(llm) == expected
    assert threading.get_ident() not in copies.waits  # the writer thread waited, never this one
    assert llm.stats()["cache_tiers"]["failed_writes"] == 0


def test_a_load_racing_a_write_still_copying_waits_for_it(tiny_llama_dir: Path) -> None:
    """(c) Round 1 evicts every system prompt while no copy completes; round 2 asks for them
    at once. Its lookups wait for those writes (the copies complete a second later) and hit:
    the answers are the prefix cache off's, each with its 64 system tokens cached."""
    prompts = rounds(2)
    reference = LLM(str(tiny_llama_dir), enable_prefix_caching=False).generate(prompts, GREEDY)
    copies = GatedCopies()
    llm = tiered(tiny_llama_dir, copies)
    assert llm.tiers is not None
    outs = one_at_a_time(llm, prompts[:6])
    gate_at_lookup: list[bool] = []
    lookup = llm.tiers.store.lookup

    def recorded_lookup(*args: Any) -> Any:
        gate_at_lookup.append(copies.gate.is_set())
        return lookup(*args)

    llm.tiers.store.lookup = recorded_lookup  # type: ignore[method-assign]
    opener = threading.Timer(1.0, copies.gate.set)
    opener.start()
    try:
        outs += one_at_a_time(llm, prompts[6:])
    finally:
        opener.cancel()
        copies.gate.set()
    assert gate_at_lookup[0] is False  # the first load raced the writes still copying
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.num_cached_tokens for o in outs] == [0] * 6 + [64] * 6
    assert llm.stats()["cache_tiers"]["tiers"]["host"]["hit_blocks"] == 6 * 4
    llm.block_manager.check_integrity()


def test_a_failed_copy_is_a_miss(tiny_llama_dir: Path) -> None:
    """(d) Every copy fails: nothing is written, round 2 finds nothing (a load racing a write
    that then fails is a miss too), and its answers are the prefix cache off's."""
    prompts = rounds(2)
    reference = LLM(str(tiny_llama_dir), enable_prefix_caching=False).generate(prompts, GREEDY)
    copies = GatedCopies(fail=True)
    llm = tiered(tiny_llama_dir, copies)
    outs = one_at_a_time(llm, prompts[:6])
    opener = threading.Timer(0.5, copies.gate.set)
    opener.start()
    try:
        outs += one_at_a_time(llm, prompts[6:])
    finally:
        opener.cancel()
        copies.gate.set()
    llm.flush_cache_tiers()
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.num_cached_tokens for o in outs] == [0] * 12
    assert host_values(llm) == {}
    stats = llm.stats()["cache_tiers"]
    assert stats["failed_writes"] > 0 and stats["tiers"]["host"]["hit_blocks"] == 0
    llm.block_manager.check_integrity()


def test_no_blocking_copy_at_commit_or_eviction(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rounds with a host tier (its copies at eviction), then with a disk tier alone (at
    commit; alone: with both, a prefetch's timing decides what is copied): the copies made at
    once (``read_blocks``, a blocking copy on a GPU) number 13 on the CPU's path, as every
    path did before; 0 with a device that queues them, whose copies the engine's thread never
    waits for; the answers the same."""
    blocking = count_blocking_reads(monkeypatch)
    prompts = rounds(2)

    def run(copies: GatedCopies | None, name: str) -> list[list[int]]:
        outs = []
        for tier in ({}, {"host_cache_bytes": None, "disk_cache_dir": str(tmp_path / name)}):
            llm = tiered(tiny_llama_dir, copies, **tier)
            for prompt in prompts:
                outs += llm.generate([prompt], GREEDY)
                llm.flush_cache_tiers()
        return [o.token_ids for o in outs]

    expected = run(None, "immediate")
    assert len(blocking) == BLOCKING_BEFORE
    blocking.clear()
    copies = GatedCopies()
    copies.gate.set()
    assert run(copies, "queued") == expected
    assert blocking == [] and copies.queued == BLOCKING_BEFORE
    assert threading.get_ident() not in copies.waits and len(copies.waits) == BLOCKING_BEFORE


# -- the store alone: payloads still being copied ------------------------------------------------
SPEC = BlockSpec("model", "float32", 4, 1, 1, 2, 2 * 1 * 4 * 1 * 2 * 4)


class Copying:
    """A block's bytes that arrive when ``gate`` opens (or fail then)."""

    def __init__(self, data: bytes, gate: threading.Event, fail: bool = False) -> None:
        self.data, self.gate, self.fail = data, gate, fail

    def result(self) -> bytes:
        if not self.gate.wait(GATE_S):
            raise TimeoutError("the test never completed the copy")
        if self.fail:
            raise RuntimeError("the device failed the copy")
        return self.data


def block(key_tokens: list[int]) -> tuple[int, int, bytes]:
    tokens = pack_tokens(key_tokens)
    return hash_packed_block(7, tokens), 7, tokens


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    return thread, result


@pytest.mark.parametrize("fail", [False, True])
def test_the_store_lookup_waits_for_a_queued_write(fail: bool) -> None:
    """A write whose bytes are still on their way queues at once; a lookup of its block
    waits for it, then finds the block's bytes (or, the copy failed, nothing)."""
    host = HostTier(2**20)
    store = TieredStore(SPEC, [host])
    key, parent, tokens = block([5, 6, 7, 8])
    data = bytes(range(SPEC.block_nbytes))
    gate = threading.Event()
    assert (
        store.write(("host",), [Pending(key, parent, tokens, True, Copying(data, gate, fail))]) == 0
    )
    thread, hits = in_thread(lambda: store.lookup([key], parent, [tokens]))
    thread.join(0.3)
    assert thread.is_alive() and len(host) == 0  # waiting for the write, which waits for its bytes
    gate.set()
    thread.join(GATE_S)
    if fail:
        assert hits == [[]] and store.stats()["failed_writes"] == 1
    else:
        assert [bytes(hit.value.kv) for hit in hits[0]] == [data]
        stored = decode(host.get_many([store.key_of(key)])[0] or b"", SPEC, key=key)
        assert isinstance(stored, BlockValue) and bytes(stored.kv) == data
    store.close()


# -- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_host_tier_overlapped_equals_tierless(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host tier in a small pool on CUDA, steps overlapped: evictions and loads while a step
    is in flight, every copy for the tiers queued (none blocking); greedy answers equal the
    tier-less engine's, and a second pass hits the host tier."""
    blocking = count_blocking_reads(monkeypatch)
    path = make_tiny_model("llama")
    prompts = rounds(3)
    common: dict[str, Any] = {
        "device": "cuda", "dtype": "float32", "attention_backend": "triton",
        "num_kv_blocks": 24, "block_size": 16,
    }  # fmt: skip
    plain = LLM(str(path), **common)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    expected_alone = [o.token_ids for p in prompts for o in plain.generate([p], GREEDY)]
    del plain
    llm = LLM(str(path), host_cache_bytes=2**26, **common)
    assert llm.overlap is not None and llm.tiers is not None
    assert llm.tiers.pool.copies is not None  # queued copies, into pinned memory
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert [o.token_ids for p in prompts for o in llm.generate([p], GREEDY)] == expected_alone
    llm.flush_cache_tiers()
    stats = llm.stats()["cache_tiers"]
    assert stats["tiers"]["host"]["written_blocks"] > 0 and stats["tiers"]["host"]["hit_blocks"] > 0
    assert stats["failed_writes"] == 0
    assert blocking == []
    llm.block_manager.check_integrity()
