"""The Triton kernels' own paths under a sliding window and a soft cap (the backend x feature
matrix, every backend against the dense reference: tests/attention/test_feature_matrix.py):
the decode kernel's partitions (a window that starts deep in a later partition, windows one key
past a partition edge; capped partitions whose log-sum-exps the reduce combines), the prefill
kernel's small tiles (a later tile's key loop starts mid-block and mid-tile), the decode and
prefill kernels agreeing on a decode step, and the windows and caps each kernel refuses. Keys
no query can see hold NaN (tests/cpu_attention_cases.py `hide_unseen`): reading them fails.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runner.attention.backend import AttentionCall
from runner.backends.triton.attention import (
    decode_attention,
    prefill_attention,
    store_kv,
    triton_paged_attention,
)
from runner.backends.triton.common import interpreting
from tests.cpu_attention_cases import PreparedStep, Seq, prepared_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"
)
SHAPES = [(4, 1), (8, 2), (16, 4)]  # (block size, query heads per KV head)
# Contexts of 1, a partial block, several blocks and 100 keys (7 partitions of 16).
DECODE_SEQS: list[Seq] = [(1, 1), (1, 7), (1, 37), (1, 100)]
# No prefix; a partial block; decode rows among prefills; many query tiles over a prefix.
MIXED_SEQS: list[Seq] = [(19, 19), (3, 8), (1, 38), (40, 61)]
TILE_FEATURES = [(window, None) for window in (1, 5, 16, 17, 30)] + [(17, 5.0)]
# A window under one token; caps that are not positive finite numbers.
REFUSED = [(0, None, "window"), (-3, None, "window")]
REFUSED += [(None, cap, "soft cap") for cap in (0.0, -5.0, float("inf"), float("nan"))]
# q . k of unit normals over 32 dims: these scales give raw scores of ~10-100.
SCALE = {None: 32**-0.5, 5.0: 2.0, 50.0: 8.0}


def case(
    seqs: list[Seq], block_size: int, group: int, window: int | None, softcap: float | None = None
) -> PreparedStep:
    """A step on the device at the cap's scale, seeded by its shape and window."""
    seed = block_size + group + (window or 0)
    scale = SCALE[softcap]
    return prepared_step(
        seqs, block_size, 2 * group, 2, 32, window, scale=scale, seed=seed, device=DEVICE
    )


def assert_reference(out: torch.Tensor, step: PreparedStep, softcap: float | None) -> None:
    assert not out.isnan().any(), "a key outside every window was read"
    expected = step.reference(softcap)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


def paged(step: PreparedStep, window: int | None, softcap: float | None, **kw: int) -> torch.Tensor:
    x = step.inputs
    args = (x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, SCALE[softcap], window, softcap)
    return triton_paged_attention(AttentionCall(*args), **kw)


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("window", [3, 13, 100, 1000, 1])
@pytest.mark.parametrize("partition_size", [16, 512])
def test_decode_window_partitions(
    block_size: int, group: int, window: int, partition_size: int
) -> None:
    """16 splits the long contexts and puts their window start deep into a later partition;
    512 keeps one partition, so the kernel writes the output itself."""
    step = case(DECODE_SEQS, block_size, group, window)
    assert step.meta.decode_only
    assert_reference(paged(step, window, None, partition_size=partition_size), step, None)


@pytest.mark.parametrize("window", [17, 33, 40])
def test_decode_window_across_partition_edges(window: int) -> None:
    """Windows one key past a partition, two partitions plus one, and unaligned, over contexts
    that differ in partition count and window start; the grid is sized by the window."""
    seqs: list[Seq] = [(1, 71), (1, 17), (1, 33), (1, 49), (1, 3)]
    step = case(seqs, 8, 2, window)
    assert_reference(paged(step, window, None, partition_size=16), step, None)


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_decode_softcap_partitions(
    block_size: int, group: int, softcap: float, window: int | None
) -> None:
    """Partitions of 16 keys: the reduce combines the capped partitions' log-sum-exps; partial
    key tiles check that padding is masked after the cap."""
    step = case(DECODE_SEQS, block_size, group, window, softcap)
    assert_reference(paged(step, window, softcap, partition_size=16), step, softcap)


@pytest.mark.parametrize(("window", "softcap"), TILE_FEATURES)
def test_prefill_small_tiles(window: int, softcap: float | None) -> None:
    """Tiles of 16 queries and keys: a later tile's key loop starts mid-block and mid-tile, and
    its queries' windows start at different keys."""
    step = case(MIXED_SEQS, 4, 2, window, softcap)
    q, k, v, k_cache, v_cache, _, meta = step.inputs
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables)
    out = prefill_attention(
        *args, SCALE[softcap], block_m=16, block_n=16, window=window, softcap=softcap
    )
    assert_reference(out, step, softcap)


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (7, None), (45, None), (None, 50.0)])
def test_decode_kernel_equals_prefill_kernel(window: int | None, softcap: float | None) -> None:
    """Both kernels can answer a decode step; with a window or a cap they must still agree."""
    step = case(DECODE_SEQS, 16, 4, window, softcap)
    q, k, v, k_cache, v_cache, _, meta = step.inputs
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale, args = SCALE[softcap], (q, k_cache, v_cache)
    features = {"window": window, "softcap": softcap}
    by_decode = decode_attention(
        *args, meta.context_lens, meta.block_tables, scale, partition_size=16, **features
    )
    by_prefill = prefill_attention(
        *args, meta.query_start_loc, meta.context_lens, meta.block_tables, scale, **features
    )
    torch.testing.assert_close(by_decode, by_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap", "named"), REFUSED)
def test_each_kernel_refuses_bad_windows_and_caps(
    window: int | None, softcap: float | None, named: str
) -> None:
    """Refused before anything is stored: the caches are as they were."""
    step = case(MIXED_SEQS, 8, 1, None)
    q, k, v, k_cache, v_cache, _, meta = step.inputs
    before = k_cache.clone()
    with pytest.raises(ValueError, match=named):
        triton_paged_attention(AttentionCall(q, k, v, k_cache, v_cache, meta, 0.2, window, softcap))
    assert torch.equal(k_cache, before), "refused, yet stored"
    features = {"window": window, "softcap": softcap}
    with pytest.raises(ValueError, match=named):
        decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, 0.2, **features)
    with pytest.raises(ValueError, match=named):
        prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.context_lens,
            meta.block_tables,
            0.2,
            **features,
        )
