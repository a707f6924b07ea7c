"""Which Hugging Face architectures the decoder runs, and how each differs from Llama: q/k/v
and o biases, q/k norms, post-norm layers. A config names its architecture (or only its
model_type); anything else is refused by name."""

from __future__ import annotations

from typing import Any

# HF architecture name -> (q/k/v bias, o_proj bias, q/k norm); None = read attention_bias.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool | None, bool | None, bool]] = {
    "LlamaForCausalLM": (None, None, False),
    "MistralForCausalLM": (False, False, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (None, None, True),
    "Phi3ForCausalLM": (False, False, False),  # q/k/v and gate/up already fused on disk
    "GraniteForCausalLM": (None, None, False),  # Llama with four scalar multipliers
    "SmolLM3ForCausalLM": (None, None, False),  # Llama without RoPE in every 4th layer
    "Olmo2ForCausalLM": (None, None, True),  # q/k norms over whole projections; post-norm
}
# Architectures whose layers norm each branch on its way out instead of in (PostNormLayer), and
# whose q/k norms span the whole projection rather than each head.
POST_NORM_ARCHITECTURES = ("Olmo2ForCausalLM",)
# Architectures that attend only to their last `sliding_window` tokens whenever their config
# sets one (Qwen2's window needs use_sliding_window as well, which the model refuses): no
# kernel here cuts a window off, so their context stops at it (engine_setup.context_length).
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "Phi3ForCausalLM")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


def resolve_architecture(config: Any) -> str:
    """The supported HF architecture of `config`, else ValueError naming it."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = getattr(config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    found = ", ".join(archs) if archs else f"model_type={model_type!r}"
    raise ValueError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
