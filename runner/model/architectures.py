"""Which Hugging Face architectures the decoder runs, and how each differs from Llama: q/k/v
and o biases, q/k norms, post-norm layers. A config names its architecture (or only its
model_type); anything else is refused by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
    "Gemma2ForCausalLM": (None, None, False),  # sandwich norms, GeLU, soft-capped scores
    "Gemma3ForCausalLM": (None, None, True),  # sandwich norms, GeLU, local and global layers
}
# Architectures whose layers norm each branch on its way out instead of in (PostNormLayer), and
# whose q/k norms span the whole projection rather than each head.
POST_NORM_ARCHITECTURES = ("Olmo2ForCausalLM",)
# Architectures whose layers norm each branch on its way in and out (SandwichNormLayer), whose
# norms scale by 1 + weight, and whose embeddings are scaled by sqrt(hidden_size): Gemma's.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Architectures whose every layer attends only to its last `sliding_window` tokens whenever
# their config sets one. The others say per layer, in `layer_types` (layer_windows).
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


# Checkpoints of a text model inside a multimodal one, whose text half runs as this
# architecture (its config under text_config, its weights under language_model.): Gemma 3 4B
# and larger, run on text alone.
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config the decoder runs: `config` itself, or a multimodal checkpoint's text_config
    named as its TEXT_OF_MULTIMODAL architecture (its images are not taken)."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in TEXT_OF_MULTIMODAL and getattr(config, "text_config", None) is not None:
            text = config.text_config
            text.architectures = [TEXT_OF_MULTIMODAL[arch]]
            return text
    return config


def resolve_architecture(config: PretrainedConfig) -> str:
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


def layer_windows(config: PretrainedConfig, arch: str) -> list[int | None]:
    """Each layer's sliding window (its last W tokens, itself included), None where it attends
    to the whole context: every layer of SLIDING_WINDOW_ARCHITECTURES when `sliding_window` is
    set; else the layers that `layer_types` names "sliding_attention" (Qwen2 and Qwen3 with
    use_sliding_window, Gemma 3's five local layers of every six)."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    if arch in SLIDING_WINDOW_ARCHITECTURES:
        return [int(window)] * num_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    return [int(window) if kind == "sliding_attention" else None for kind in types]
