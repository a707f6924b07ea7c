"""How each architecture's config names its sliding windows and its RoPE settings per layer
type (the windows themselves, across the attention backends: tests/attention/test_feature_matrix.py;
the engine against transformers with windows: the windowed fixtures of
tests/engine/test_engine_equivalence.py's ARCH_FIXTURES)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runner.model.architectures import layer_windows
from runner.model.layers import layer_rope_types, rope_parameters


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
