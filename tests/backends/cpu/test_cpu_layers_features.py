"""Sliding windows and soft caps through the CPU's C layers (runner/model/cpu_layers.py: every
layer of a step in one C call): a Mistral with a window and Gemma 2 with its caps give the module
path's hidden states bit for bit, the Mistral close to the modules over the dense reference
(tests/cpu_attention_cases.py), and neither the results without the feature."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import MistralConfig

from kvcache import LLM
from runner.attention.backend import Attend, AttentionBackend, AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.torch.paged import write_kv
from runner.kv_pool.store import KVStore
from runner.model.cpu_layers import CpuLayers
from runner.model.decoder import CausalLM
from runner.model.decoder_layers import Attention
from tests.backends.cpu.test_cpu_layers_gemma import assert_c_layers_match_modules, run_schedule
from tests.cpu_attention_cases import Seq, dense_reference, loaded, random_tables
from tests.cpu_models import CpuModel, of_engine, packed

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

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


def reference_attention(call: AttentionCall) -> torch.Tensor:
    """The attention contract through dense_reference, for the module path (Mistral caps
    no scores: softcap stays None)."""
    assert call.softcap is None
    meta, k_cache, v_cache = call.meta, call.k_cache, call.v_cache
    write_kv(call.k, call.v, k_cache, v_cache, meta.slot_mapping)
    seqs = list(zip(meta.query_lens, meta.context_lens_host, strict=True))
    tables = meta.block_tables.tolist()
    return dense_reference(call.q, k_cache, v_cache, tables, seqs, call.scale, call.window).float()


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
