"""The torch paged-attention path, and the CPU backend's decode kernel, against a naive
per-token reference: random shapes, GQA ratios, block sizes, cached-prefix lengths and mixed
decode/prefill batches."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.registry import paged_attention
from runner.backends.torch.cascade import MIN_SHARED_TOKENS
from runner.backends.torch.context_parts import MIN_RUN_TOKENS
from runner.backends.torch.plan import CASCADE_MAX_QUERY_LEN, GROUP_MAX_QUERY_LEN


def naive_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, B, Hkv, D] with the new tokens already written
    v_cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Token by token, in float64: query i of a sequence sits at C - L + i and sees 0..pos
    (with a sliding window W, only pos - W + 1..pos)."""
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for q_len, ctx, table in zip(query_lens, context_lens, tables, strict=True):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        keys = k_cache.reshape(-1, hkv, k_cache.shape[-1])[slots].double()  # [C, Hkv, D]
        vals = v_cache.reshape(-1, hkv, v_cache.shape[-1])[slots].double()
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        for i in range(q_len):
            pos = ctx - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            seen_k, seen_v = keys[first : pos + 1], vals[first : pos + 1]
            scores = torch.einsum("hd,chd->hc", q[row].double(), seen_k) * scale
            out[row] = torch.einsum("hc,chd->hd", scores.softmax(-1), seen_v)
            row += 1
    return out


def run_case(
    seqs: list[tuple[int, int]],  # (query_len, context_len) per sequence
    hq: int,
    hkv: int,
    block_size: int,
    head_dim: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    consecutive_prefix: bool = False,
    plans: list[Any] | None = None,
    backend: str = "torch",
    cache_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged_attention output, naive output) for one random batch. With `shared_blocks`, every
    table starts with the same blocks (a cached prompt the sequences share). The step's attention
    plan is appended to `plans` when given, for tests that check which path ran. The caches are
    of `cache_dtype` (default `dtype`): the new K/V are stored rounded to it, and the naive
    reference reads them as stored. `window`: a sliding window for both."""
    cache_dtype = cache_dtype or dtype
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) - shared_blocks for _, ctx in seqs]
    num_blocks = sum(blocks_needed) + shared_blocks + 3
    ids = list(range(1, num_blocks))  # block 0 stays unused, as padding points at it
    rng.shuffle(ids)
    if consecutive_prefix:
        run = range(2, 2 + shared_blocks)  # the prefix as one range of the pool, in order
        ids = list(run) + [b for b in ids if b not in run]
    prefix, taken = ids[:shared_blocks], shared_blocks
    tables = []
    for n in blocks_needed:
        tables.append(prefix + ids[taken : taken + n])
        taken += n
    # The cached prefix is random data already in the store; new tokens are written.
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim).to(cache_dtype)
    q_lens = [q for q, _ in seqs]
    ctxs = [c for _, c in seqs]
    t = sum(q_lens)
    q = torch.randn(t, hq, head_dim).to(dtype)
    k = torch.randn(t, hkv, head_dim).to(dtype)
    v = torch.randn(t, hkv, head_dim).to(dtype)
    meta = AttentionMetadata.build(q_lens, ctxs, tables, block_size)
    scale = head_dim**-0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale, backend, window)
    if plans is not None:
        plans.append(meta._torch_plan)
    # The new K/V must sit at their slots.
    flat_k = k_cache.view(-1, hkv, head_dim)
    assert torch.equal(flat_k[meta.slot_mapping], k.to(cache_dtype))
    assert torch.equal(v_cache.view(-1, hkv, head_dim)[meta.slot_mapping], v.to(cache_dtype))
    ref = naive_attention(q, k_cache, v_cache, q_lens, ctxs, tables, scale, window)
    return out, ref


LONG = GROUP_MAX_QUERY_LEN + 7  # a query long enough to run alone


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_naive(hq: int, hkv: int, block_size: int) -> None:
    seqs = [
        (1, 1),  # first decode step of a 0-token... (a 1-token prompt)
        (LONG, LONG),  # fresh prefill: SDPA on k/v directly
        (1, 37),  # decode
        (LONG, LONG + 21),  # prefill chunk after a cached prefix
        (5, 5),  # short fresh prefill: grouped with the decodes
        (3, 40),  # short suffix after a prefix: grouped, padded to the longest short query
        (1, 16),
    ]
    out, ref = run_case(seqs, hq, hkv, block_size, seed=hq * 100 + block_size)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_naive(seed: int) -> None:
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 3])
    block_size = rng.choice([2, 8, 16])
    seqs = []
    for _ in range(rng.randint(1, 6)):
        q_len = rng.choice([1, 1, 2, rng.randint(1, 40)])
        seqs.append((q_len, q_len + rng.choice([0, rng.randint(1, 50)])))
    out, ref = run_case(seqs, hq, hkv, block_size, head_dim=rng.choice([8, 32]), seed=seed)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(6, 2, 8), (4, 4, 4), (8, 1, 16)])
def test_shared_prefix_batch_matches_naive(
    hq: int, hkv: int, block_size: int, consecutive: bool
) -> None:
    """Decodes and suffixes up to CASCADE_MAX_QUERY_LEN after one shared cached prompt go
    through the cascade path together and stay exact; a longer suffix runs alone."""
    shared = -(-MIN_SHARED_TOKENS // block_size) + 1
    p = shared * block_size
    longest = CASCADE_MAX_QUERY_LEN + 5
    seqs = [(1, p + 1), (5, p + 5), (LONG, p + LONG), (1, p + 42), (longest, p + longest)]
    seqs += [(16, p + 20), (3, p + 32), (CASCADE_MAX_QUERY_LEN, p + CASCADE_MAX_QUERY_LEN)]
    plans: list[Any] = []
    out, ref = run_case(
        seqs,
        hq,
        hkv,
        block_size,
        seed=hq + block_size,
        shared_blocks=shared,
        consecutive_prefix=consecutive,
        plans=plans,
    )
    (plan,) = plans
    assert len(plan.singles) == 1 and plan.singles[0].end - plan.singles[0].start == longest
    assert plan.group is not None and plan.group.shared is not None
    assert (plan.group.shared.block_range is not None) == consecutive
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_only_batch_matches_naive() -> None:
    seqs = [(1, c) for c in (1, 9, 16, 17, 33, 64)]
    out, ref = run_case(seqs, hq=6, hkv=2, block_size=8)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_single_fresh_prefill_matches_naive() -> None:
    out, ref = run_case([(50, 50)], hq=4, hkv=2, block_size=16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close_to_reference() -> None:
    seqs = [(1, 20), (LONG, LONG + 5), (4, 4)]
    out, ref = run_case(seqs, hq=4, hkv=2, block_size=4, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_plan_is_reused_across_layers() -> None:
    meta = AttentionMetadata.build([3, 1], [3, 8], [[1], [2, 3]], block_size=4)
    caches = [torch.zeros(4, 4, 2, 8) for _ in range(2)]
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    paged_attention(q, k, v, caches[0], caches[1], meta, 0.5)
    plan = meta._torch_plan
    assert plan is not None
    paged_attention(q, k, v, caches[0], caches[1], meta, 0.5)
    assert meta._torch_plan is plan


def test_build_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError):
        AttentionMetadata.build([5], [4], [[1]], block_size=16)  # query longer than context
    with pytest.raises(ValueError):
        AttentionMetadata.build([1], [20], [[1]], block_size=16)  # too few blocks
    with pytest.raises(ValueError):
        AttentionMetadata.build([1, 1], [1], [[1]], block_size=16)


def test_unknown_backend_is_refused() -> None:
    meta = AttentionMetadata.build([1], [1], [[0]], block_size=4)
    x = torch.zeros(1, 1, 4)
    cache = torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(x, x, x, cache, cache, meta, 1.0, backend="cuda-magic")


def test_triton_backend_dispatches_with_the_same_contract() -> None:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the triton backend needs CUDA or TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    seqs = [(1, 9), (LONG, LONG + 5), (3, 3)]
    tables = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    meta_args = ([q for q, _ in seqs], [c for _, c in seqs], tables, 4)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, 16, device=device) for h in (4, 2, 2))
    outs = []
    for backend in ("torch", "triton"):
        caches = [torch.zeros(12, 4, 2, 16, device=device) for _ in range(2)]
        meta = AttentionMetadata.build(*meta_args, device=device)
        outs.append(paged_attention(q, k, v, *caches, meta, 0.25, backend=backend))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_shared_prefix_bfloat16_runs_close_to_reference() -> None:
    shared = -(-MIN_SHARED_TOKENS // 8) + 1
    p = shared * 8
    seqs = [(1, p + 3), (LONG, p + LONG), (2, p + 9)]
    plans: list[Any] = []
    out, ref = run_case(
        seqs,
        6,
        2,
        8,
        dtype=torch.bfloat16,
        shared_blocks=shared,
        consecutive_prefix=True,
        plans=plans,
    )
    assert plans[0].group.shared is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_long_query_after_a_cached_prompt_matches_naive(block_size: int, consecutive: bool) -> None:
    """A chunk too long for the group reads its cached prompt in place when that prompt's
    blocks are consecutive, else gathers them with its own blocks; both stay exact, with a
    partly filled block between the prefix and the chunk."""
    shared = -(-MIN_RUN_TOKENS // block_size) + 2
    p = shared * block_size
    longest = CASCADE_MAX_QUERY_LEN + 9
    seqs = [(longest, p + 3 + longest)]
    plans: list[Any] = []
    out, ref = run_case(
        seqs, 6, 2, block_size, shared_blocks=shared, consecutive_prefix=consecutive, plans=plans
    )
    (single,) = plans[0].singles
    assert single.parts is not None and single.parts.gathers[-1].mask is not None
    assert all(gather.mask is None for gather in single.parts.gathers[:-1])
    assert single.parts.runs == ([slice(2, 2 + shared)] if consecutive else [])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def fragmented_table(runs: list[int], seed: int) -> list[int]:
    """A block table made of runs of consecutive pool ids of the given lengths, the runs in a
    random order of the pool with gaps between them (block 0 left unused)."""
    rng = random.Random(seed)
    ranges, at = [], 1
    for length in runs:
        at += rng.randint(1, 3)  # a gap: the runs are not one range
        ranges.append(range(at, at + length))
        at += length
    rng.shuffle(ranges)
    return [block for run in ranges for block in run]


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    query_len=st.sampled_from([1, 1, 2, 5, 20]),
    partial=st.integers(0, 6),
    group=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_a_fragmented_context_read_in_parts_matches_naive(
    runs: list[int], query_len: int, partial: int, group: int, seed: int
) -> None:
    """A sequence running alone whose blocks lie in runs of the pool (short and long, in any
    order): the long runs before its first query are read in place, the rest is gathered once,
    and the merged result equals attention over the whole context token by token. A decode's
    plan needs no mask."""
    block_size, hkv = 8, 2
    table = fragmented_table(runs, seed)
    ctx = (len(table) - 1) * block_size + partial + 2  # the last block partly filled
    query_len = min(query_len, ctx - 1)
    torch.manual_seed(seed)
    num_blocks = max(table) + 1
    k_cache = torch.randn(num_blocks, block_size, hkv, 16)
    v_cache = torch.randn(num_blocks, block_size, hkv, 16)
    q = torch.randn(query_len, hkv * group, 16)
    k, v = torch.randn(query_len, hkv, 16), torch.randn(query_len, hkv, 16)
    meta = AttentionMetadata.build([query_len], [ctx], [table], block_size)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, "torch")
    ref = naive_attention(q, k_cache, v_cache, [query_len], [ctx], [table], 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    (single,) = meta._torch_plan.singles  # alone, even a decode runs as a single
    parts = single.parts
    assert parts is not None and (parts.gathers[-1].mask is None) == (query_len == 1)
    assert len(parts.gathers) == 1 or query_len > 1
    read_in_place = sum(run.stop - run.start for run in parts.runs)
    assert read_in_place * block_size + sum(gather.keys for gather in parts.gathers) == ctx
    assert all((run.stop - run.start) * block_size >= MIN_RUN_TOKENS for run in parts.runs)


def test_a_float16_cache_read_in_parts_stays_close() -> None:
    """Runs read in place from a float16 cache are widened like the gathered rest."""
    block_size = 16
    table = fragmented_table([20, 3, 17, 2], seed=3)
    ctx = len(table) * block_size - 5
    torch.manual_seed(3)
    k_cache = torch.randn(max(table) + 1, block_size, 3, 64).half()
    v_cache = torch.randn(max(table) + 1, block_size, 3, 64).half()
    q, k, v = torch.randn(1, 9, 64), torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    meta = AttentionMetadata.build([1], [ctx], [table], block_size)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, "torch")
    assert len(meta._torch_plan.singles[0].parts.runs) == 2
    ref = naive_attention(q, k_cache, v_cache, [1], [ctx], [table], 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_a_long_context_among_short_decodes_runs_alone() -> None:
    """Padding eight ~40-token decodes to one 600-token context would multiply their work: the
    long one leaves the group (exactly, like any single), contexts of similar length stay."""
    seqs = [(1, 600)] + [(1, 30 + 3 * i) for i in range(8)]
    plans: list[Any] = []
    out, ref = run_case(seqs, 6, 2, 8, seed=5, plans=plans)
    (plan,) = plans
    assert [(s.start, s.end) for s in plan.singles] == [(0, 1)]
    assert plan.group is not None and plan.group.num_seqs == 8
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    plans.clear()
    run_case([(1, 100 + 20 * i) for i in range(6)], 6, 2, 8, plans=plans)
    assert not plans[0].singles and plans[0].group.num_seqs == 6


def test_without_the_flash_kernel_shared_prefixes_are_gathered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch lacks the CPU flash op (or off the CPU) nothing is split: the same batch is
    planned as a plain padded group plus a gathered single, and stays exact."""
    import runner.backends.torch.plan as attention_plan

    monkeypatch.setattr(attention_plan, "cascade_supported", lambda device: False)
    shared = -(-MIN_SHARED_TOKENS // 8) + 1
    p = shared * 8
    seqs = [(1, p + 3), (2, p + 9), (LONG, p + LONG)]
    plans: list[Any] = []
    out, ref = run_case(seqs, 6, 2, 8, shared_blocks=shared, consecutive_prefix=True, plans=plans)
    (plan,) = plans
    assert plan.group is not None and plan.group.shared is None
    assert [s.parts for s in plan.singles] == [None]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_long_suffix_after_a_shared_prefix_runs_alone() -> None:
    """In a cascade only the keys after the shared prefix are padded: a decode 400 tokens past
    the prefix leaves the group (and still reads the prefix in place), one 100 tokens past it
    stays, since padding that little costs less than a call of its own."""
    shared = -(-MIN_SHARED_TOKENS // 8) + 1
    p = shared * 8
    seqs = [(1, p + 400), (1, p + 100)] + [(1, p + 3 + i) for i in range(6)]
    plans: list[Any] = []
    out, ref = run_case(seqs, 6, 2, 8, shared_blocks=shared, consecutive_prefix=True, plans=plans)
    (plan,) = plans
    assert [(s.start, s.end) for s in plan.singles] == [(0, 1)]
    assert plan.singles[0].parts is not None
    assert plan.group is not None and plan.group.shared is not None
    assert plan.group.num_seqs == 7
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


needs_cpu_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)


def chunk_lists(max_cached: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """1-5 prefill chunks as (query_len, context_len): 1-40 new tokens after 0..max_cached."""
    chunk = st.tuples(st.integers(1, 40), st.integers(0, max_cached))
    return st.lists(chunk.map(lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=5)


def cpu_plan_against_naive(
    seqs: list[tuple[int, int]], hq: int, hkv: int, block_size: int, **options: Any
) -> Any:
    """Run one step on the "cpu" backend, check it against the naive reference, and return the
    torch path's plan: None when the kernels took the whole step."""
    plans: list[Any] = []
    out, ref = run_case(seqs, hq, hkv, block_size, plans=plans, backend="cpu", **options)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    return plans[0]


@needs_cpu_kernels
@settings(max_examples=30, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    hkv=st.integers(1, 3),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    block_size=st.sampled_from([1, 2, 8, 16, 32]),
    shared_blocks=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_cpu_decode_kernel_matches_naive(
    contexts: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    block_size: int,
    shared_blocks: int,
    seed: int,
) -> None:
    # Sequences that share leading blocks (a prompt) read them in place like any other block.
    shared = min(shared_blocks, (min(contexts) - 1) // block_size)
    seqs = [(1, ctx) for ctx in contexts]
    plan = cpu_plan_against_naive(
        seqs, hkv * group, hkv, block_size, head_dim=head_dim, seed=seed, shared_blocks=shared
    )
    assert plan is None  # the kernel ran: the torch path plans every step it takes


@needs_cpu_kernels
@settings(max_examples=30, deadline=None)
@given(
    seqs=chunk_lists(max_cached=40),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 9]),  # 9: over the decode kernel's 8, decodes go along
    head_dim=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernels_match_naive_on_mixed_batches(
    seqs: list[tuple[int, int]],
    hkv: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
) -> None:
    """Prefill chunks (fresh, or after a cached prefix) in the prefill kernel, decodes beside
    them in the decode kernel, one step."""
    plan = cpu_plan_against_naive(seqs, hkv * group, hkv, block_size, head_dim=head_dim, seed=seed)
    assert plan is None  # the kernels ran: the torch path plans every step it takes


@needs_cpu_kernels
def test_cpu_backend_falls_back_to_torch_outside_the_kernels() -> None:
    seqs = [(1, 9), (LONG, LONG + 5), (3, 12)]
    plan = cpu_plan_against_naive(seqs, 4, 2, 4, head_dim=8)  # head size 8
    assert plan is not None  # the torch path planned the step: no kernel ran


@needs_cpu_kernels
def test_cpu_prefill_kernel_with_token_rows_4kb_apart() -> None:
    # 8 KV heads of 128: the prefill kernel reads each chunk of keys from a copy (L1 aliasing).
    seqs = [(20, 20), (9, 37), (1, 30)]
    assert cpu_plan_against_naive(seqs, 16, 8, 16, head_dim=128) is None


@needs_cpu_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(9, 3, 16), (4, 1, 8), (16, 2, 32)])
def test_cpu_decode_kernel_scores_a_shared_prefix_once(
    hq: int,
    hkv: int,
    block_size: int,
    cache_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decodes whose tables start with the same blocks: the kernel is told to score the prefix
    for all rows in 16-lane tiles, then each sequence carries on through its own keys. Decodes
    beside a prefill chunk in the same step get the shared pass too. A float16 cache's shared
    blocks are widened once for the pass."""
    from runner.backends.cpu.kernel import CpuKernels

    passed: list[int] = []
    original = CpuKernels.decode_attention

    def recording(self: CpuKernels, *args: Any, **kwargs: Any) -> torch.Tensor:
        passed.append(args[6] if len(args) > 6 else 0)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CpuKernels, "decode_attention", recording)
    shared = -(-80 // block_size)  # at least 80 tokens, over MIN_SHARED_TOKENS
    contexts = [shared * block_size + extra for extra in (1, 5, 17, 30, 2, 44, 9)]
    decodes = [(1, c) for c in contexts]
    options = {"shared_blocks": shared, "cache_dtype": cache_dtype}
    cpu_plan_against_naive(decodes, hq, hkv, block_size, head_dim=64, **options)
    assert passed == [shared]
    passed.clear()
    chunk = (7, shared * block_size + 12)
    cpu_plan_against_naive([chunk, *decodes], hq, hkv, block_size, **options)
    assert passed == [shared]


@needs_cpu_kernels
def test_cpu_kernels_read_q_as_a_view_of_the_fused_projection() -> None:
    # In the model q is [T, Hq, D] cut from [T, Hq + Hkv, D]: tokens are further apart than
    # Hq * D, and the kernels read it in place.
    torch.manual_seed(3)
    hq, hkv, d, block_size = 6, 2, 32, 8
    seqs = [(12, 12), (5, 29), (1, 17)]
    tables = [[1, 2], [3, 4, 5, 6], [7, 8, 9]]
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, block_size)
    fused = torch.randn(meta.num_tokens, hq + hkv, d)
    k, v = torch.randn(meta.num_tokens, hkv, d), torch.randn(meta.num_tokens, hkv, d)
    caches = [torch.randn(10, block_size, hkv, d) for _ in range(2)]
    outs = []
    for q in (fused[:, :hq], fused[:, :hq].contiguous()):
        k_cache, v_cache = (c.clone() for c in caches)
        step = AttentionMetadata.build(
            [q for q, _ in seqs], [c for _, c in seqs], tables, block_size
        )
        outs.append(paged_attention(q, k, v, k_cache, v_cache, step, d**-0.5, "cpu"))
    assert torch.equal(outs[0], outs[1])


@needs_cpu_kernels
@settings(max_examples=30, deadline=None)
@given(
    seqs=chunk_lists(max_cached=60),
    decodes=st.lists(st.integers(1, 70), max_size=4),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([1, 8, 16]),
    shared_blocks=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernels_over_a_float16_cache_match_naive(
    seqs: list[tuple[int, int]],
    decodes: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    block_size: int,
    shared_blocks: int,
    seed: int,
) -> None:
    """kv_cache_dtype="float16": float32 queries, keys and values stored as float16 (rounded
    as torch rounds), widened as the decode and prefill kernels read them; decode-only steps
    (with a shared prefix) and mixed ones."""
    # Decodes alone may share leading blocks (their queries are past them); prefill chunks
    # write their own blocks.
    shared = min(shared_blocks, (min(decodes, default=1) - 1) // block_size)
    steps = [([(1, ctx) for ctx in decodes], shared), (seqs + [(1, ctx) for ctx in decodes], 0)]
    for step, prefix in steps:
        if not step:
            continue
        plan = cpu_plan_against_naive(
            step,
            hkv * group,
            hkv,
            block_size,
            head_dim=head_dim,
            seed=seed,
            cache_dtype=torch.float16,
            shared_blocks=prefix,
        )
        assert plan is None  # the kernels ran


@pytest.mark.parametrize("seed", range(4))
def test_torch_path_over_a_float16_cache_matches_naive(seed: int) -> None:
    """The torch path (no C kernels) stores rounded K/V and attends to them as stored, fresh
    prompts included."""
    seqs = [(LONG, LONG), (5, 40), (1, 30), (1, 17), (3, 3)]
    out, ref = run_case(seqs, 6, 2, 8, head_dim=32, seed=seed, cache_dtype=torch.float16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
