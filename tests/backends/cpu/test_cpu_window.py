"""Sliding-window attention in the CPU C kernels (runner/backends/cpu/csrc): a query at position p
sees its sequence's keys p - W < j <= p only. Checked against a dense float64 reference
(tests/cpu_attention_cases.py: each sequence's keys read through its block table, masked,
softmaxed), for decodes, prefill
chunks after cached prefixes and mixes of both; windows under a block, across block edges,
past the context, of one token; float16 caches; decodes whose shared prompt the window cuts
into (where the decode kernel's shared pass must not run). Then a Mistral with a window through
the C layers (runner/model/cpu_layers.py): bit for bit the module path, close to the
reference."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
import torch
from cpu_attention_cases import Seq, dense_reference, loaded, random_inputs, random_tables
from cpu_models import CpuModel, packed
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MistralConfig

from kvcache.store import KVStore
from runner.attention.backend import Attend, AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.attention.paged import write_kv
from runner.backends.cpu.attention import cpu_paged_attention
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.split import CpuSplit
from runner.model.cpu_layers import CpuLayers
from runner.model.decoder import CausalLM
from runner.model.decoder_layers import Attention

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)


def attend_step(
    seqs: list[Seq],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    window: int | None,
    cache_dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """cpu_paged_attention over a random cache and step (its new K/V written first), and the
    dense reference over the cache as it then is. Returns (kernels' out, reference, meta)."""
    x = random_inputs(seqs, block_size, hq, hkv, d, cache_dtype, shared_blocks, seed)
    scale = d**-0.5
    out = cpu_paged_attention(x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, scale, window)
    reference = dense_reference(x.q, x.k_cache, x.v_cache, x.tables, seqs, scale, window)
    return out, reference, x.meta


def assert_matches(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), reference, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2), (8, 2)])  # GQA 1, 2, 4
@pytest.mark.parametrize("window", [1, 3, 4, 7, 16, 21, 200, None])
@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_windows_match_the_dense_reference(
    block_size: int, hq: int, hkv: int, window: int | None, kind: str
) -> None:
    """Windows under a block, of a whole block, across block edges, past every context, of one
    token, none; decodes alone and beside prefill chunks after cached prefixes."""
    seqs: list[Seq] = [(1, 1), (1, 9), (1, 16), (1, 23), (1, 40)]
    if kind == "mixed":
        seqs += [(37, 37), (20, 45), (3, 19), (16, 16)]
    out, reference, _ = attend_step(seqs, block_size, hq, hkv, 32, window, seed=block_size)
    assert_matches(out, reference)


@pytest.mark.parametrize("window", [1, 5, 13, 64, None])
def test_float16_caches(window: int | None) -> None:
    """Float16 caches: decodes widen as they read, chunks widen from their window's block."""
    seqs: list[Seq] = [(1, 30), (1, 7), (24, 60), (5, 33), (40, 40)]
    out, reference, _ = attend_step(seqs, 4, 8, 2, 64, window, torch.float16, seed=3)
    assert_matches(out, reference)


@pytest.mark.parametrize("window", [1, 30, 48, 50, 64, 90, 200, None])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_chunk", [False, True])
def test_decodes_after_a_shared_prompt(
    window: int | None, cache_dtype: torch.dtype, with_chunk: bool
) -> None:
    """6 decodes x 4 query heads a KV head over a 5-block shared prompt (80 tokens): enough rows
    for the decode kernel's shared pass. Windows that start inside the shared blocks (on a
    block edge or not), past them, or before every context (200: the pass may run)."""
    decodes: list[Seq] = [(1, 81 + 7 * s) for s in range(6)]
    seqs = decodes + [(9, 100)] if with_chunk else decodes
    out, reference, meta = attend_step(seqs, 16, 8, 2, 64, window, cache_dtype, 5, seed=5)
    assert_matches(out, reference)
    split = meta._cpu_split
    assert isinstance(split, CpuSplit) and split.shared_blocks == 5  # the pass was offered


@pytest.mark.parametrize("window", [20, 70, 100, 200])
def test_the_decode_kernel_drops_a_shared_pass_a_window_cuts_into(window: int) -> None:
    """Asked for the shared pass outright: with any window starting past key 0 it reads each
    sequence's window instead; with windows reaching key 0 it may use the pass."""
    kernels = loaded()
    seqs: list[Seq] = [(1, 81 + 3 * s) for s in range(8)]
    gen = torch.Generator().manual_seed(7)
    tables, num_blocks = random_tables(seqs, 16, 5, random.Random(7))
    k_cache, v_cache = (torch.randn(num_blocks, 16, 1, 32, generator=gen) for _ in range(2))
    q = torch.randn(len(seqs), 2, 32, generator=gen)
    meta = AttentionMetadata.build([1] * len(seqs), [ctx for _, ctx in seqs], tables, 16)
    out = kernels.decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.2, 5, window
    )
    assert_matches(out, dense_reference(q, k_cache, v_cache, tables, seqs, 0.2, window))


def test_a_window_under_one_is_refused() -> None:
    q, cache, one = torch.zeros(1, 2, 16), torch.zeros(2, 4, 2, 16), torch.ones(1, 1)
    with pytest.raises(ValueError, match="at least 1"):
        loaded().prefill_attention(q, cache, cache, one, one[0] - 1, one[0], one[0], q, 1.0, 0)


@st.composite
def random_step(draw: st.DrawFn) -> dict[str, Any]:
    """attend_step's arguments: any head shape the kernels take, block size, window, cache
    dtype and mix of decodes and chunks."""
    seqs: list[Seq] = []
    for _ in range(draw(st.integers(1, 6))):
        q_len = draw(st.sampled_from([1, 1, 2, 7, 16, 17, 33]))
        seqs.append((q_len, q_len + draw(st.integers(0, 45))))
    hkv = draw(st.integers(1, 2))
    return {
        "seqs": seqs,
        "block_size": draw(st.sampled_from([1, 4, 16])),
        "hq": hkv * draw(st.sampled_from([1, 2, 4])),
        "hkv": hkv,
        "d": draw(st.sampled_from([16, 48])),
        "window": draw(st.none() | st.integers(1, 70)),
        "cache_dtype": draw(st.sampled_from([torch.float32, torch.float16])),
    }


@settings(max_examples=60, deadline=None)
@given(case=random_step())
def test_random_steps_match_the_dense_reference(case: dict[str, Any]) -> None:
    out, reference, _ = attend_step(**case)
    assert_matches(out, reference)


# ---- a Mistral with a sliding window, every layer in one C call ----

MISTRAL_STEPS: dict[str, list[Seq]] = {
    "decodes": [(1, 40), (1, 33), (1, 13), (1, 5)],
    "prefill": [(40, 40), (15, 43)],
    "mixed": [(1, 30), (12, 12), (1, 7), (5, 41), (1, 39)],
}


def mistral(window: int | None) -> CpuModel:
    """A random 2-layer Mistral (every layer windowed), packed for the C layers."""
    torch.manual_seed(0)
    shape: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
    shape |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = MistralConfig(vocab_size=96, sliding_window=window, **shape)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    cpu_model = packed(model)
    assert cpu_model.stack is not None
    return cpu_model


def run_step(
    cpu_model: CpuModel,
    seqs: list[Seq],
    block_size: int,
    in_c: bool,
    seed: int = 1,
    attend: Attend | None = None,
) -> torch.Tensor:
    """The model's hidden states for one step over a seeded random cache; `in_c`: through its C
    layers (asserted to run), else through the modules, which attend with `attend` if given."""
    model, layers = cpu_model
    rng = random.Random(seed)
    tables, num_blocks = random_tables(seqs, block_size, 0, rng)
    positions = [p for q_len, ctx in seqs for p in range(ctx - q_len, ctx)]
    ids = torch.tensor([rng.randrange(96) for _ in positions])
    kv = KVStore(model.num_layers, num_blocks, block_size, 2, 16, torch.float32, "cpu")
    torch.manual_seed(seed)
    kv.tensor.normal_()  # the cached context
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, block_size)
    assert layers is not None
    calls: list[int] = []
    run = layers.kernels.run_layers

    def counted(*args: Any) -> int:
        calls.append(args[1])  # the step's rows
        return int(run(*args))

    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(layers.kernels, "run_layers", counted)
        backend = cpu_model.backend(in_c)
        if attend is not None:
            backend = AttentionBackend("reference", attend)
        out = model(ids, torch.tensor(positions), meta, kv, backend)
    assert calls == ([len(ids)] if in_c else [])
    return out


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The attention contract through dense_reference, for the module path (Mistral caps
    no scores: softcap stays None)."""
    assert softcap is None
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    seqs = list(zip(meta.query_lens, meta.context_lens_host, strict=True))
    tables = meta.block_tables.tolist()
    return dense_reference(q, k_cache, v_cache, tables, seqs, scale, window).float()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", list(MISTRAL_STEPS))
@pytest.mark.parametrize("mixed_layers", [False, True])
def test_mistral_layers_in_c_with_a_window(block_size: int, kind: str, mixed_layers: bool) -> None:
    """Window 12 over contexts of up to 45: the C layers give the module path's hidden states
    bit for bit, close to the modules over the dense reference, and not the windowless ones.
    `mixed_layers`: the second layer attends to the whole context (Qwen2's, Gemma 3's mix)."""
    model = mistral(12)
    attention = [cast(Attention, layer.self_attn) for layer in model.model.layers]
    assert [a.sliding_window for a in attention] == [12, 12]
    if mixed_layers:
        attention[1].sliding_window = None
        model = CpuModel(model.model, CpuLayers.for_model(model.model, loaded()))
    seqs = MISTRAL_STEPS[kind]
    in_c = run_step(model, seqs, block_size, in_c=True)
    assert torch.equal(in_c, run_step(model, seqs, block_size, in_c=False))
    reference = run_step(model, seqs, block_size, in_c=False, attend=reference_attention)
    torch.testing.assert_close(in_c, reference, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(in_c, run_step(mistral(None), seqs, block_size, in_c=True))
