"""Sliding-window attention: the torch path against a naive reference that attends to each
query's last W tokens, and how each architecture's config names its windows and RoPE settings.
(Engine against transformers with windows: the windowed fixtures of
tests/engine/test_engine_equivalence.py's ARCH_FIXTURES; the C and Triton kernels:
tests/backends/cpu/test_cpu_window.py and tests/backends/triton/test_triton_window.py.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from test_attention import run_case

from runner.model.architectures import layer_windows
from runner.model.layers import layer_rope_types, rope_parameters


@pytest.mark.parametrize("window", [1, 3, 4, 9, 16, 200])
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(4, 4, 4), (4, 2, 8), (8, 1, 16)])
def test_torch_path_attends_to_the_last_window_tokens(
    window: int, hq: int, hkv: int, block_size: int
) -> None:
    seqs = [
        (1, 1),  # a one-token prompt
        (30, 30),  # a fresh prefill longer than most windows: SDPA with the window's mask
        (1, 37),  # decodes
        (1, 9),
        (24, 50),  # a chunk after a cached prefix, run alone
        (5, 5),  # short queries, grouped with the decodes
        (3, 40),
    ]
    out, ref = run_case(seqs, hq, hkv, block_size, seed=window, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_torch_path_with_a_shared_prefix_and_a_window(seed: int) -> None:
    """Decodes that share a cached prompt would read it once for all (runner/attention/cascade.py);
    a window that starts inside it must still hide its older keys."""
    rng = random.Random(seed)
    seqs = [(rng.choice([1, 1, 3]), rng.randrange(70, 90)) for _ in range(5)]
    window = rng.choice([5, 17, 40])
    out, ref = run_case(seqs, 4, 2, 8, seed=seed, shared_blocks=6, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_window_past_every_context_is_full_attention() -> None:
    seqs = [(1, 20), (12, 12), (4, 30)]
    windowed, ref = run_case(seqs, 4, 2, 4, seed=1, window=31)
    full, _ = run_case(seqs, 4, 2, 4, seed=1)
    assert torch.equal(windowed, full)
    torch.testing.assert_close(windowed.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding window 0"):
        run_case([(1, 4)], 2, 2, 4, window=0)


def _config(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=4, **fields)


def test_which_layers_have_a_window() -> None:
    # Mistral and Phi-3: every layer, when the config sets one.
    assert layer_windows(_config(sliding_window=64), "MistralForCausalLM") == [64] * 4
    assert layer_windows(_config(sliding_window=None), "MistralForCausalLM") == [None] * 4
    # The others: the layers that layer_types names (Qwen2's use_sliding_window, Gemma 3).
    types = ["sliding_attention", "full_attention"] * 2
    assert layer_windows(_config(sliding_window=8, layer_types=types), "Gemma3ForCausalLM") == [
        8,
        None,
        8,
        None,
    ]
    assert layer_windows(_config(sliding_window=8), "Qwen2ForCausalLM") == [None] * 4
    with pytest.raises(ValueError, match="layer_types names 2 layers"):
        layer_windows(_config(sliding_window=8, layer_types=types[:2]), "Qwen2ForCausalLM")


def test_rope_settings_per_layer_type() -> None:
    """Gemma 3's local layers rotate with their own base: transformers 5 keys rope_parameters
    by layer type, 4.x names it rope_local_base_freq beside rope_theta. The full-attention
    layers rotate with the default settings (None: the model's own table)."""
    types = ["sliding_attention", "full_attention"] * 2
    own = ["sliding_attention", None] * 2
    v5 = _config(
        layer_types=types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        },
    )
    assert layer_rope_types(v5) == own
    assert rope_parameters(v5, "sliding_attention")["rope_theta"] == 10_000.0
    assert rope_parameters(v5)["rope_type"] == "linear"  # the full layers' by default
    v4 = _config(
        layer_types=types, rope_theta=1e6, rope_local_base_freq=10_000.0, rope_scaling=None
    )
    assert layer_rope_types(v4) == own
    assert rope_parameters(v4, "sliding_attention") == {
        "rope_type": "default",
        "rope_theta": 10_000.0,
    }
    assert rope_parameters(v4)["rope_theta"] == 1e6
    # One setting for all layers: no per-layer tables, even where layer_types exist (Qwen2).
    assert layer_rope_types(_config(layer_types=types, rope_theta=1e6)) == [None] * 4
