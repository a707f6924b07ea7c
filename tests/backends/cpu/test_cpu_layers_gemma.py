"""Gemma 3's sandwich layers in one C call (runner/backends/cpu/csrc/layers.c,
runner/model/cpu_layers.py): four norms a layer scaling by 1 + weight, q/k normed per head, the
tanh GeLU, and local layers with a window and a RoPE table of their own. Over several engine-like
steps (prompts, chunks after them, decodes, contexts past the window), the hidden states and every
layer's K/V written are bit for bit the module path's; the comparison catches a skipped norm. The
GeLU kernel both paths call sits within one ulp of tanh of torch's F.gelu. Greedy equality with
transformers runs through these layers in tests/engine/test_engine_equivalence.py
(tiny_gemma3_dir)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cpu_models import CpuModel, of_engine

from kvcache import LLM
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from runner.kv_pool.store import KVStore
from runner.model.cpu_layers import MAX_ROPE_TABLES, CpuLayers
from runner.model.decoder_layers import SandwichNormLayer

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

# Slots of layers.c's per-layer weights enum that the checks below clear.
POST_NORM, FFN_NORM, PRE_FFN_NORM, WEIGHTS_PER_LAYER = 7, 12, 13, 14
# A second tiny Gemma 3: three layers (local, local, global), a window of 7 under the block
# size, wider heads, and an intermediate of 512 (the down product reads a padded copy).
WIDER = {
    "hidden_size": 96,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 7,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
}
# (sequence, tokens computed this step): three sequences, each a prompt in one step or in
# chunks, then decodes, every context ending past the windows (16 and 7).
SCHEDULE = [
    [(0, 30), (1, 12)],
    [(0, 1), (1, 28)],
    [(0, 1), (1, 1), (2, 21)],
    *[[(0, 1), (1, 1), (2, 1)]] * 4,
    [(1, 1), (2, 9)],
]


@pytest.fixture(scope="module", params=["tiny", "wider"])
def gemma(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path]) -> CpuModel:
    """A tiny Gemma 3 as the engine readies it on this CPU: packed, its layers in C."""
    overrides = WIDER if request.param == "wider" else {}
    cpu_model = of_engine(LLM(str(make_tiny_model("gemma3", **overrides))))
    assert cpu_model.stack is not None
    assert all(isinstance(layer, SandwichNormLayer) for layer in cpu_model.model.layers)
    return cpu_model


def run_schedule(
    cpu_model: CpuModel, block_size: int, cache_dtype: torch.dtype, in_c: bool
) -> tuple[list[torch.Tensor], KVStore]:
    """Every step of SCHEDULE on a fresh cache, through the C layers (asserted to run) or the
    modules; each step's hidden states and the cache after the last."""
    model, layers = cpu_model
    rng = random.Random(7)
    lengths = [sum(n for step in SCHEDULE for s, n in step if s == seq) for seq in range(3)]
    tokens = [[rng.randrange(300) for _ in range(n)] for n in lengths]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 4
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # tables scattered over the pool
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    kv = KVStore(*shape, cache_dtype, "cpu")
    assert layers is not None and layers.takes(kv)
    calls: list[int] = []
    run = layers.kernels.run_layers
    done, outs = [0, 0, 0], []
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(layers.kernels, "run_layers", lambda *a: calls.append(a[1]) or run(*a))
        for step in SCHEDULE:
            ids, positions = [], []
            for seq, n in step:
                ids += tokens[seq][done[seq] : done[seq] + n]
                positions += range(done[seq], done[seq] + n)
                done[seq] += n
            lens, contexts = [n for _, n in step], [done[s] for s, _ in step]
            meta = AttentionMetadata.build(lens, contexts, [tables[s] for s, _ in step], block_size)
            outs.append(
                model(torch.tensor(ids), torch.tensor(positions), meta, kv, cpu_model.backend(in_c))
            )
    assert calls == ([sum(n for _, n in step) for step in SCHEDULE] if in_c else [])
    return outs, kv


def assert_c_layers_match_modules(
    model: CpuModel, block_size: int, cache_dtype: torch.dtype
) -> None:
    """The schedule's hidden states after every step, and the whole KV cache after it, are bit
    for bit the same through layers.c as through the modules."""
    in_c, kv_c = run_schedule(model, block_size, cache_dtype, in_c=True)
    modules, kv_modules = run_schedule(model, block_size, cache_dtype, in_c=False)
    for step, (ours, theirs) in enumerate(zip(in_c, modules, strict=True)):
        assert torch.equal(ours, theirs), f"step {step}"
    assert torch.equal(kv_c.tensor, kv_modules.tensor)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_sandwich_layers_in_c_match_the_modules_bit_for_bit(
    gemma: CpuModel, block_size: int, cache_dtype: torch.dtype
) -> None:
    assert_c_layers_match_modules(gemma, block_size, cache_dtype)


def test_the_layers_take_two_rope_tables_and_offset_norms(gemma: CpuModel) -> None:
    """Local and global layers rotate with a table each (1 and 2, by first use); every norm
    layers.c reads is 1 + weight, q/k norms included; the MLP gates with the GeLU."""
    layers = gemma.stack
    assert layers is not None and layers.gelu
    kinds = gemma.model.layer_rope_types
    assert layers._rope_layers is not None
    assert list(layers._rope_layers) == [1 + layers._rope_kinds.index(k) for k in kinds]
    assert set(layers._rope_layers) == {1, 2}
    for i, layer in enumerate(gemma.model.layers):
        tensors = layers._tensors[i * WEIGHTS_PER_LAYER : (i + 1) * WEIGHTS_PER_LAYER]
        norms = [
            (0, layer.input_layernorm),
            (3, layer.self_attn.q_norm),
            (4, layer.self_attn.k_norm),
            (POST_NORM, layer.post_attention_layernorm),
            (FFN_NORM, layer.post_feedforward_layernorm),
            (PRE_FFN_NORM, layer.pre_feedforward_layernorm),
        ]
        for slot, norm in norms:
            assert torch.equal(tensors[slot], norm.weight.detach() + 1.0)


@pytest.fixture
def broken(gemma: CpuModel) -> Iterator[CpuLayers]:
    """The model's C layers, to break for one test; their norms and tables put back after."""
    layers = gemma.stack
    assert layers is not None and layers._rope_layers is not None
    weights, tables = list(layers._weights), list(layers._rope_layers)
    yield layers
    for i, pointer in enumerate(weights):
        layers._weights[i] = pointer
    for i, table in enumerate(tables):
        layers._rope_layers[i] = table


@pytest.mark.parametrize("fault", ["no-post-attention-norm", "no-pre-ffn-norm", "swapped-rope"])
def test_a_skipped_norm_or_wrong_table_fails_the_comparison(
    gemma: CpuModel, broken: CpuLayers, fault: str
) -> None:
    """With the first layer's post-attention (or pre-feedforward) norm left out in C, or its
    RoPE table swapped for the other, its hidden states are no longer the modules': the
    bit-for-bit test compares real work."""
    modules, _ = run_schedule(gemma, 4, torch.float32, in_c=False)
    if fault == "swapped-rope":
        assert broken._rope_layers is not None
        broken._rope_layers[0] = 3 - broken._rope_layers[0]
    else:
        broken._weights[POST_NORM if fault == "no-post-attention-norm" else PRE_FFN_NORM] = None
    in_c, _ = run_schedule(gemma, 4, torch.float32, in_c=True)
    assert not torch.equal(in_c[0], modules[0])


def test_models_the_layers_cannot_take_run_the_modules(gemma: CpuModel) -> None:
    """Layers of two activations, or of a third RoPE table: no C layers (one flag, two tables)."""
    kernels = load_cpu_kernels()
    layers = list(gemma.model.layers)
    if len(layers) > MAX_ROPE_TABLES:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layers[0].self_attn, "rope_type", "third")
            assert CpuLayers.for_model(gemma.model, kernels) is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers[0].mlp, "activation", "silu")
        assert CpuLayers.for_model(gemma.model, kernels) is None
    assert CpuLayers.for_model(gemma.model, kernels) is not None


def gelu_inputs(seed: int) -> torch.Tensor:
    """[rows, 2 * 96]: gate values over GeLU's whole range (its flat negative tail, the steep
    middle, large |x| whose cube overflows, tiny and zero ones), up all ones."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 << 16
    gate = torch.cat(
        [
            torch.randn(n, generator=gen),
            torch.randn(n, generator=gen) * 4,
            torch.randn(n, generator=gen) * 30,
            torch.logspace(-30, 30, 4096) * torch.tensor([1.0, -1.0]).repeat(2048),
            torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38]),
        ]
    )
    gate = torch.cat([gate, torch.zeros(-gate.numel() % 96)]).view(-1, 96)
    return torch.cat([gate, torch.ones_like(gate)], dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_gelu_is_within_one_ulp_of_tanh_of_torch(seed: int) -> None:
    """torch's vector tanh is within one ulp, ours correctly rounded (but for rare ties within
    1e-13), so they differ by at most one ulp of tanh: 0.5 |x| ulp(1 + tanh) and the final
    rounding, |x| 2^-24 + ulp(y) (bounded twice over). Most values agree exactly."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    gate_up = gelu_inputs(seed)
    gate = gate_up[:, :96]
    ours = kernels.gelu_tanh_and_mul(gate_up)
    theirs = F.gelu(gate, approximate="tanh")
    ulp = torch.nextafter(theirs.abs(), torch.tensor(float("inf"))) - theirs.abs()
    bound = 2 * (gate.abs() * 2.0**-24 + ulp)
    assert bool(((ours - theirs).abs() <= bound).all())
    assert (ours != theirs).float().mean().item() < 0.01
    assert torch.equal(ours[gate.abs() > 20], theirs[gate.abs() > 20])  # tanh is +-1 there


def test_gelu_and_mul_rounds_the_product_once() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 48, generator=gen) * 3
    gate, up = gate_up.split(48, dim=1)
    alone = kernels.gelu_tanh_and_mul(torch.cat([gate, torch.ones_like(up)], dim=1))
    assert torch.equal(kernels.gelu_tanh_and_mul(gate_up), alone * up)


def test_the_module_path_calls_the_same_gelu(gemma: CpuModel, monkeypatch: Any) -> None:
    """MLP.forward of a packed model goes through the kernel (not F.gelu), so the C layers and
    the modules agree bit for bit."""
    layers = gemma.stack
    assert layers is not None
    calls: list[int] = []
    gelu = layers.kernels.gelu_tanh_and_mul
    monkeypatch.setattr(
        layers.kernels, "gelu_tanh_and_mul", lambda x: calls.append(x.shape[0]) or gelu(x)
    )
    mlp = gemma.model.layers[0].mlp
    with torch.inference_mode():
        mlp(torch.randn(3, gemma.model.hidden_size))
    assert calls == [3]
