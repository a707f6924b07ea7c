"""Small building blocks of the decoder: RMSNorm and rotary embeddings.

Numerics follow transformers' Llama code (norm in float32, cos/sin computed in float32
and cast to the model dtype) so that our logits match HF's on the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.backends.cpu.kernel import CpuKernels

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# RoPE types whose inverse frequencies are fixed at load time. "dynamic" changes with the
# sequence length, which a KV cache cannot follow (cached keys would carry stale rotations), so
# it is refused; "longrope" (Phi-3.5, Phi-4-mini) is fixed up to its original context, where it
# uses its short factors, and the engine's context stops there (rope_context_limit).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float = 1e-6, scale_in_float32: bool = False, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # OLMo 2 and Gemma scale before rounding to the input dtype, the others after (the
        # same thing in float32; one rounding apart in bfloat16).
        self.scale_in_float32 = scale_in_float32
        # Gemma stores its norms' weights less one: it scales by (1 + weight), in float32.
        self.offset = offset
        # The CPU kernels, once the model is packed for them: one pass instead of five.
        self.kernels: CpuKernels | None = None

    def scale(self) -> torch.Tensor:
        """What the normalised rows are multiplied by: the weight, plus Gemma's offset (added
        in float32, as transformers adds it, so a bfloat16 weight loses nothing)."""
        return self.weight if self.offset == 0.0 else self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.kernels.rowwise_supported(x, x.shape[-1]):
            return self.kernels.rms_norm(x, self.scale(), self.eps)
        if x.is_cuda and x.dtype != torch.float32:
            if self.scale_in_float32 or self.weight.dtype == x.dtype:
                # One Triton kernel instead of about eight: torch_path's operations and dtypes,
                # in one pass (runner/backends/triton/rms_norm.py). Triton is needed on GPUs only.
                from runner.backends.triton.rms_norm import rms_norm

                return rms_norm(x, self.scale(), self.eps, self.scale_in_float32)
        if x.dtype == torch.float32:
            # One fused kernel; identical math to torch_path in float32.
            return F.rms_norm(x, (x.shape[-1],), self.scale(), self.eps)
        return self.torch_path(x)

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether `add_forward` can take x: one dtype throughout (or a float32 scale applied
        before rounding, as OLMo 2 and Gemma do) and no CPU kernels in charge."""
        return self.kernels is None and (self.scale_in_float32 or self.weight.dtype == x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) in one Triton kernel (`fusable` first): the
        residual add folded into this norm, with the sum rounded to x's dtype as torch's add
        rounds it (runner/backends/triton/fused_elementwise.py). Triton is needed on GPUs only."""
        from runner.backends.triton.fused_elementwise import add_rms_norm

        shape = x.shape
        out, total = add_rms_norm(
            x.reshape(-1, shape[-1]),
            residual.reshape(-1, shape[-1]),
            self.scale(),
            self.eps,
            self.scale_in_float32,
        )
        return out.view(shape), total.view(shape)

    def torch_path(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' order of operations, in torch: normalise in float32, then round to
        the input dtype and scale (or scale in float32, then round). The reference of the
        other paths, and the path of 16-bit activations on the CPU."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.scale().float() * xf).to(x.dtype)
        return self.scale() * xf.to(x.dtype)


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of a config, for transformers 5 (rope_parameters) and 4.x
    (rope_theta + rope_scaling) alike. Always has 'rope_type' and 'rope_theta'. `layer_type`
    picks a model's settings for one kind of layer where they differ (Gemma 3's
    "sliding_attention" layers rotate with another base: transformers 5 keys rope_parameters
    by layer type, 4.x gives rope_local_base_freq); None: the full-attention layers'."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_type" not in params:  # keyed by layer type
            key = layer_type or "full_attention"
            if key not in params:
                raise ValueError(f"rope_parameters name no {key!r} layers")
            params = params[key]
        params = dict(params)
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        params = {"rope_type": "default", "rope_theta": float(config.rope_local_base_freq)}
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    return params


def layer_rope_types(config: PretrainedConfig) -> list[str | None]:
    """Which RoPE settings each layer rotates with: None where they are the model's default
    (its full-attention layers'), else the layer's type, whose settings rope_parameters gives
    (Gemma 3's local layers rotate with another base); None for every layer where the config
    names no layer types or one setting serves them all."""
    types = getattr(config, "layer_types", None)
    if not types:
        return [None] * int(config.num_hidden_layers)
    default = rope_parameters(config)
    return [None if rope_parameters(config, kind) == default else kind for kind in types]


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates (partial_rotary_factor: Phi-4-mini
    rotates 3/4 of each head and passes the rest through)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * float(factor))
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor={factor} leaves {dim} rotary dims of {head_dim}")
    return dim


def rope_context_limit(config: PretrainedConfig) -> int | None:
    """The longest context the RoPE tables serve, where that is shorter than the model's
    positions: a longrope model's original context (past it, transformers switches every
    position to the long factors, which cached keys cannot follow). None otherwise."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return int(original) if original else None


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) and the cos/sin scale factor, for
    the layers of `layer_type` (rope_parameters)."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = rotary_dim(config, head_dim)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponent), 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # Reuse transformers' own formulas for the scaled variants: they are pure functions
    # of the config and exactly what HF's model computes.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keyed = getattr(config, "rope_parameters", None) or {}
    by_type = layer_type is not None and "rope_type" not in keyed and "rope_theta" not in keyed
    options = {"layer_type": layer_type} if by_type else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, **options)
    return inv_freq.float().cpu(), float(scale)


def rope_cos_sin(
    config: PretrainedConfig,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layer_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, rotary_dim] in `dtype`, indexed by position: cos repeated
    over both halves, sin negated over the first (so apply_rope needs no negation)."""
    inv_freq, scale = rope_inv_freq(config, head_dim, layer_type)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], same products as HF
    cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
    sin = (freqs.sin() * scale).to(device=device, dtype=dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, H, D]; cos/sin [T, R] from rope_cos_sin, gathered by position:
    the first R dims of each head rotate (rotate-half within them), the rest pass through.

    HF computes x * cat(c, c) + cat(-x2, x1) * cat(s, s); here the second product is
    cat(x2, x1) * cat(-s, s), the same numbers, with one operation fewer."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    out = x * cos[:, None, :]
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return out.add_(rotated.mul_(sin[:, None, :]))
