"""Attention logit soft-capping (Gemma 2) in the CPU C kernels (runner/backends/cpu/csrc): each
score s = (q . k) * scale becomes c * tanh(s / c) before the mask and the softmax (the cap itself
and its vector tanh: test_soft_cap.py). The decode and prefill kernels with caps that bite (scores
of magnitude 10-100 against caps of 5 and 50) against a dense float64 reference
(tests/cpu_attention_cases.py: keys read through block tables, capped, masked, softmaxed), over
block sizes, GQA groups, decodes alone and beside prefill chunks after cached prefixes, sliding
windows, float16 caches, and decodes whose shared prompt the decode kernel scores in its shared
pass. Last, Gemma 2's layers in one C call: bit for bit the module path."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_attention_cases import Seq, dense_reference, loaded, random_inputs, random_tables
from cpu_models import CpuModel, of_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_layers_gemma import assert_c_layers_match_modules, run_schedule
from test_cpu_window import random_step as random_window_step

from kvcache import LLM
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.attention import cpu_paged_attention
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.split import SHARED_PREFIX_MIN_ROWS, CpuSplit
from runner.model.cpu_layers import CpuLayers

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

# Queries this many times a unit normal, at scale 1: q . k over D = 32..64 dims has a standard
# deviation of 28-40, so scores of 10-100 in magnitude, which caps of 5 and 50 bend.
Q_GAIN = 5.0


def attend_step(
    seqs: list[Seq],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    window: int | None,
    softcap: float | None,
    cache_dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, Callable[[float | None], torch.Tensor], AttentionMetadata]:
    """cpu_paged_attention at scale 1 over a random cache and step (its new K/V written first)
    with queries Q_GAIN times a unit normal. Returns the kernels' out, the dense reference over
    the cache as it then is (for any cap: to check that the cap changed something) and meta."""
    x = random_inputs(seqs, block_size, hq, hkv, d, cache_dtype, shared_blocks, seed, Q_GAIN)
    out = cpu_paged_attention(x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, 1.0, window, softcap)

    def reference(cap: float | None) -> torch.Tensor:
        return dense_reference(x.q, x.k_cache, x.v_cache, x.tables, seqs, 1.0, window, cap)

    return out, reference, x.meta


# Scores of ~50 carry ~5e-6 of float32 rounding, which the softmax passes on as relative error
# in the weights; the outputs are weighted means of unit normals.
TOLERANCE = 1e-4


def assert_matches(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), reference, atol=TOLERANCE, rtol=TOLERANCE)


def assert_capped(
    out: torch.Tensor, reference: Callable[[float | None], torch.Tensor], c: float
) -> None:
    """out matches the capped reference and is far from the uncapped one, beyond any doubt of
    rounding (the cap bit)."""
    assert_matches(out, reference(c))
    off = (out.double() - reference(None)).abs().max().item()
    assert off > 50 * TOLERANCE, f"the cap did not bite: {off} off the uncapped reference"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2), (8, 2)])  # GQA 1, 2, 4
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 7, 21])
@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_capped_scores_match_the_dense_reference(
    block_size: int, hq: int, hkv: int, softcap: float, window: int | None, kind: str
) -> None:
    """Decodes alone (decode_attention.c) and beside prefill chunks after cached prefixes
    (prefill_attention.c's tiles), with and without a window."""
    seqs: list[Seq] = [(1, 1), (1, 9), (1, 16), (1, 23), (1, 40)]
    if kind == "mixed":
        seqs += [(37, 37), (20, 45), (3, 19), (16, 16)]
    out, reference, _ = attend_step(seqs, block_size, hq, hkv, 32, window, softcap, seed=hq)
    assert_capped(out, reference, softcap)


@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_float16_caches(softcap: float, window: int | None) -> None:
    """Float16 caches: decodes widen as they read, chunks from a widened copy."""
    seqs: list[Seq] = [(1, 30), (1, 7), (24, 60), (5, 33), (40, 40)]
    out, reference, _ = attend_step(seqs, 4, 8, 2, 64, window, softcap, torch.float16, seed=3)
    assert_capped(out, reference, softcap)


@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 200, 50])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_chunk", [False, True])
def test_decodes_after_a_shared_prompt(
    softcap: float, window: int | None, cache_dtype: torch.dtype, with_chunk: bool
) -> None:
    """6 decodes x 4 query heads a KV head over a 5-block shared prompt (80 tokens): 24 rows, so
    the decode kernel scores the shared blocks for all rows at once (tile_attend), which must
    cap too; a window of 200 reaches key 0 (the pass runs), one of 50 cuts into the prompt (it
    does not)."""
    decodes: list[Seq] = [(1, 81 + 7 * s) for s in range(6)]
    assert len(decodes) * 4 >= SHARED_PREFIX_MIN_ROWS
    seqs = decodes + [(9, 100)] if with_chunk else decodes
    out, reference, meta = attend_step(seqs, 16, 8, 2, 64, window, softcap, cache_dtype, 5, 5)
    assert_capped(out, reference, softcap)
    split = meta._cpu_split
    assert isinstance(split, CpuSplit) and split.shared_blocks == 5  # the pass was offered


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_shared_pass_caps_as_each_task_does(cache_dtype: torch.dtype) -> None:
    """The decode kernel asked outright with and without its shared pass (16 decodes x 2 query
    heads a KV head over 3 shared blocks): both the capped reference, far from the uncapped."""
    kernels = loaded()
    seqs: list[Seq] = [(1, 49 + 5 * s) for s in range(16)]
    gen = torch.Generator().manual_seed(11)
    tables, num_blocks = random_tables(seqs, 16, 3, random.Random(11))
    k_cache, v_cache = (torch.randn(num_blocks, 16, 2, 48, generator=gen) for _ in range(2))
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(len(seqs), 4, 48, generator=gen) * Q_GAIN
    meta = AttentionMetadata.build([1] * len(seqs), [ctx for _, ctx in seqs], tables, 16)
    reference = dense_reference(q, k_cache, v_cache, tables, seqs, 1.0, None, 5.0)
    for shared in (0, 3):
        out = kernels.decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, 1.0, shared, None, 5.0
        )
        assert_matches(out, reference)
    uncapped = dense_reference(q, k_cache, v_cache, tables, seqs, 1.0, None, None)
    assert (out.double() - uncapped).abs().max() > 50 * TOLERANCE


def test_a_cap_far_above_every_score_changes_next_to_nothing() -> None:
    """c = 1e30: c * tanh(s / c) is s to within an ulp (tanh's series, then a product), so the
    capped kernels give the uncapped reference's result."""
    seqs: list[Seq] = [(1, 30), (1, 45), (12, 40), (33, 33)]
    out, reference, _ = attend_step(seqs, 16, 4, 2, 32, None, 1e30, seed=9)
    assert_matches(out, reference(None))


def test_heads_the_kernels_cannot_take_cap_through_the_torch_path() -> None:
    """A head size of 24 (not a multiple of 16): cpu_paged_attention hands window and cap to
    the torch path, which caps as the reference does."""
    assert not loaded().prefill_supported(torch.empty(0, 2, 24), torch.empty(0, 4, 2, 24))
    seqs: list[Seq] = [(1, 30), (9, 40)]
    out, reference, _ = attend_step(seqs, 4, 4, 2, 24, 11, 5.0, seed=4)
    assert_capped(out, reference, 5.0)


@st.composite
def random_step(draw: st.DrawFn) -> dict[str, Any]:
    """attend_step's arguments: test_cpu_window's random step (head shapes, block size, window,
    cache dtype, decodes and chunks) and a cap."""
    return {**draw(random_window_step()), "softcap": draw(st.sampled_from([1.0, 5.0, 20.0, 50.0]))}


@settings(max_examples=40, deadline=None)
@given(case=random_step())
def test_random_capped_steps_match_the_dense_reference(case: dict[str, Any]) -> None:
    out, reference, _ = attend_step(**case)
    assert_matches(out, reference(case["softcap"]))


# ---- Gemma 2's layers in one C call ----


@pytest.fixture(scope="module")
def gemma2(make_tiny_model: Callable[..., Path]) -> CpuModel:
    """The tiny Gemma 2 (caps of 5 on its scores, a window of 16 in its local layer) as the
    engine readies it on this CPU: packed, its layers in C."""
    cpu_model = of_engine(LLM(str(make_tiny_model("gemma2"))))
    assert cpu_model.stack is not None
    return cpu_model


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_gemma2_layers_in_c_match_the_modules_bit_for_bit(
    gemma2: CpuModel, block_size: int, cache_dtype: torch.dtype
) -> None:
    """Prompts, chunks after them and decodes: the C layers pass the cap to both kernels as the
    module path passes it to cpu_paged_attention, so hidden states and K/V come out equal."""
    layers = gemma2.stack
    assert layers is not None and layers.softcap == 5.0
    assert_c_layers_match_modules(gemma2, block_size, cache_dtype)


def test_gemma2_layers_in_c_without_the_cap_differ(gemma2: CpuModel) -> None:
    """The C layers with their cap taken away no longer give the module path's states: the
    comparison above sees the cap."""
    layers = gemma2.stack
    assert layers is not None
    modules, _ = run_schedule(gemma2, 4, torch.float32, in_c=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "softcap", None)
        in_c, _ = run_schedule(gemma2, 4, torch.float32, in_c=True)
    assert not torch.equal(in_c[0], modules[0])


def test_layers_of_different_caps_run_the_modules(gemma2: CpuModel) -> None:
    """layers.c takes one cap for the model: layers that disagree get no C layers."""
    kernels = loaded()
    attention = gemma2.model.layers[1].self_attn
    for cap in (7.0, None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "softcap", cap)
            assert CpuLayers.for_model(gemma2.model, kernels) is None
    assert CpuLayers.for_model(gemma2.model, kernels) is not None
