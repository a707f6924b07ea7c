"""Attention-logit soft capping (Gemma 2) in the Triton kernels against a dense float64 reference.

With a cap c each score s = (q . k) * scale becomes c * tanh(s / c), then the causal (and sliding
window) mask applies and the softmax follows, as in transformers' Gemma 2 eager attention. The
scales here put raw scores around 10-100, so the cap changes the result far beyond the tolerance
(checked). The kernels hold scores in base 2; the reference works in natural units throughout.
Keys that no query of a sequence can see (before every window) hold NaN, as in
tests/backends/triton/test_triton_window.py: a kernel that read them would return NaN.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_window import (
    DECODE_SEQS,
    MIXED_SEQS,
    SHAPES,
    TOL,
    make_case,
    reference,
    run_and_check,
)

from runner.backends.triton.attention import (
    decode_attention,
    prefill_attention,
    store_kv,
    triton_paged_attention,
)
from runner.backends.triton.common import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"
)
# q . k of unit normals has a standard deviation of sqrt(32) ~ 5.7: these scales give raw scores
# of ~10-100, where a cap of 5 or 50 bites hard.
SCALE = {5.0: 2.0, 50.0: 8.0}


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_decode_softcap(block_size: int, group: int, softcap: float, window: int | None) -> None:
    """Partitions of 16 keys: the long contexts are split, so the reduce combines the capped
    partitions' log-sum-exps; partial key tiles check that padding is masked after the cap."""
    case = make_case(DECODE_SEQS, block_size, group, seed=block_size + int(softcap), window=window)
    assert case.meta.decode_only
    run_and_check(case, window, SCALE[softcap], softcap, partition_size=16)


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_prefill_softcap(block_size: int, group: int, softcap: float, window: int | None) -> None:
    """Cached prefixes, a decode row among prefills, and queries whose causal diagonal cuts a
    key tile: the masked keys must stay out after the cap (tanh(-inf) would be -1)."""
    seed = 3 * block_size + int(softcap)
    case = make_case(MIXED_SEQS, block_size, group, seed=seed, window=window)
    assert not case.meta.decode_only
    run_and_check(case, window, SCALE[softcap], softcap)


@pytest.mark.parametrize("decode", [False, True])
def test_cap_changes_the_result(decode: bool) -> None:
    """The scales above make the cap matter: capped and plain references are far apart."""
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 8, 2, seed=1)
    for softcap, scale in SCALE.items():
        gap = reference(case, scale, None, softcap) - reference(case, scale, None)
        assert gap.abs().max() > 100 * TOL[torch.float32]


@pytest.mark.parametrize("decode", [False, True])
def test_no_softcap_is_plain_attention(decode: bool) -> None:
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 8, 2, seed=7)
    run_and_check(case, None, 0.3, partition_size=16)


@pytest.mark.parametrize("decode", [False, True])
def test_bfloat16_softcap(decode: bool) -> None:
    seqs = DECODE_SEQS if decode else MIXED_SEQS
    case = make_case(seqs, 16, 2, seed=5, window=21, dtype=torch.bfloat16)
    run_and_check(case, 21, SCALE[50.0], 50.0, partition_size=16)


def test_small_tiles_with_window() -> None:
    """Tiles of 16 queries and keys: later tiles start their key loop mid-block and mid-tile."""
    case = make_case(MIXED_SEQS, 4, 2, seed=9, window=17)
    meta, scale = case.meta, SCALE[5.0]
    expected = reference(case, scale, 17, 5.0)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, meta.query_start_loc, meta.context_lens)
    out = prefill_attention(
        *args, meta.block_tables, scale, block_m=16, block_n=16, window=17, softcap=5.0
    )
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


def test_decode_kernel_equals_prefill_kernel() -> None:
    case = make_case(DECODE_SEQS, 16, 4, seed=3)
    meta, scale = case.meta, SCALE[50.0]
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache)
    by_decode = decode_attention(
        *args, meta.context_lens, meta.block_tables, scale, partition_size=16, softcap=50.0
    )
    by_prefill = prefill_attention(
        *args, meta.query_start_loc, meta.context_lens, meta.block_tables, scale, softcap=50.0
    )
    torch.testing.assert_close(by_decode, by_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, -5.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(softcap: float) -> None:
    case = make_case(MIXED_SEQS, 8, 1, seed=0)
    meta = case.meta
    before = case.k_cache.clone()
    with pytest.raises(ValueError, match="soft cap"):
        triton_paged_attention(
            case.q, case.k, case.v, case.k_cache, case.v_cache, meta, 0.2, softcap=softcap
        )
    assert torch.equal(case.k_cache.nan_to_num(), before.nan_to_num()), "refused, yet stored"
    args = (case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="soft cap"):
        decode_attention(*args, meta.context_lens, meta.block_tables, 0.2, softcap=softcap)
    with pytest.raises(ValueError, match="soft cap"):
        prefill_attention(
            *args, meta.query_start_loc, meta.context_lens, meta.block_tables, 0.2, softcap=softcap
        )
