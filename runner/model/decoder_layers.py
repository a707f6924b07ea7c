"""The decoder's layers over flat (varlen) token batches: attention (q/k/v fused into one
projection, RoPE, paged attention), the gated MLP (gate/up fused; SiLU, or Gemma's tanh GeLU),
and the three ways a layer wires them: pre-norm (Llama and most others), post-norm (OLMo 2)
and both (Gemma 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.backend import Attend, AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.kernel import CpuKernels
from runner.model.architectures import (
    GEMMA_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    layer_windows,
)
from runner.model.layers import RMSNorm, apply_rope, layer_rope_types
from runner.model.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: str, layer: int) -> None:
        super().__init__()
        # SmolLM3 leaves RoPE out of some layers (no_rope_layers[i] == 0: no rotation there).
        no_rope_layers = getattr(config, "no_rope_layers", None)
        self.use_rope = bool(no_rope_layers[layer]) if no_rope_layers else True
        # Attends to its last `sliding_window` tokens only; None: the whole context.
        self.sliding_window = layer_windows(config, arch)[layer]
        # Gemma 2 caps every score s at c * tanh(s / c) before the softmax (None: no cap).
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        # Which of the model's RoPE tables it rotates with (None: its default one).
        self.rope_type = layer_rope_types(config)[layer]
        qkv_bias, o_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads not a multiple of {self.num_kv_heads}")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Granite sets the attention's scale itself, Gemma through query_pre_attn_scalar;
        # everyone else scales by 1/sqrt(head_dim).
        pre_attn_scalar = getattr(config, "query_pre_attn_scalar", None)
        default_scale = (pre_attn_scalar or self.head_dim) ** -0.5
        self.scale = float(getattr(config, "attention_multiplier", None) or default_scale)
        self.qkv_proj = nn.Linear(
            hidden,
            self.q_size + 2 * self.kv_size,
            bias=attention_bias if qkv_bias is None else qkv_bias,
        )
        self.o_proj = nn.Linear(
            self.q_size, hidden, bias=attention_bias if o_bias is None else o_bias
        )
        self.qk_norm_per_head = arch not in POST_NORM_ARCHITECTURES  # Qwen3's; OLMo 2's whole
        q_width, k_width = (
            (self.head_dim, self.head_dim) if self.qk_norm_per_head else (self.q_size, self.kv_size)
        )
        gemma = arch in GEMMA_ARCHITECTURES
        in_float32, offset = not self.qk_norm_per_head or gemma, 1.0 if gemma else 0.0
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(q_width, eps, in_float32, offset) if qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, in_float32, offset) if qk_norm else None
        # Tensor parallel (runner/model/sharding.py): this rank's heads only, and the output
        # projection's partial sums added over the ranks.
        self.tp: TensorParallel | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [blocks, B, Hkv, D]
        v_cache: torch.Tensor,
        attend: Attend,
        attend_stored: Attend | None = None,
    ) -> torch.Tensor:
        """`attend_stored` (a GPU step with Triton attention): RoPE and the K/V store in one
        Triton kernel (runner/backends/triton/rope_store.py), then this attention, which
        stores nothing; layers without RoPE, or tensors the kernel does not take, run as
        before."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            if self.qk_norm_per_head:  # Qwen3: norm per head, before RoPE
                q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
                k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            else:  # OLMo 2: norm across all heads, before RoPE
                q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
                k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
        else:
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
        if attend_stored is not None and self.use_rope:
            from runner.backends.triton.rope_store import rope_store, rope_store_fits

            if rope_store_fits(q, k, v, cos, k_cache):
                q = rope_store(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
                attend = attend_stored  # K/V are in the cache now
        if attend is not attend_stored:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            else:
                # q and k heads side by side rotate in one pass: [T, Hq + Hkv, D], then split.
                qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
                q, k = self._rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        o = attend(  # [T, Hq, D]
            AttentionCall(
                q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap
            )
        )
        out: torch.Tensor = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin) if self.use_rope else x


# The gated MLP's activations: SiLU (Llama and most others) and the tanh GeLU (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        # Gemma names it hidden_activation, the others hidden_act.
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.activation = act
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)
        # The CPU kernels, once the model is packed for them: the activation and the product in
        # one pass (the same kernel as runner/backends/cpu/csrc/layers.c's, so both paths agree bit
        # for bit).
        self.kernels: CpuKernels | None = None
        self.tp: TensorParallel | None = None  # as Attention's

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: SiLU(gate) * up in one Triton kernel (a GPU step with Triton attention)."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        silu = self.activation == "silu"
        kernels = self.kernels
        if fused and silu and gate_up.dim() == 2:
            from runner.backends.triton.fused_elementwise import silu_mul

            act = silu_mul(gate_up)  # one kernel for the split, the SiLU and the product
        elif kernels is not None and kernels.rowwise_supported(gate_up, self.intermediate):
            act = kernels.silu_and_mul(gate_up) if silu else kernels.gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
            act = (F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up
        out: torch.Tensor = self.down_proj(act)
        return out if self.tp is None else self.tp.all_reduce(out)


class ResidualLayer(nn.Module):
    """What the three layouts share: attention, then the gated MLP, each a residual branch of
    the hidden stream; a subclass says where the norms stand (`branches`)."""

    def __init__(self, config: PretrainedConfig, arch: str, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, layer)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attend: Attend,
        fused: bool = False,
        attend_stored: Attend | None = None,
    ) -> torch.Tensor:
        """`fused` (a GPU step with Triton attention): the layout's elementwise work in Triton
        kernels where it has them, SiLU(gate) * up in one; the same roundings as torch's.
        `attend_stored`: RoPE and the K/V store fused too (Attention.forward)."""

        def attention(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.self_attn(
                x, cos, sin, meta, k_cache, v_cache, attend, attend_stored
            )
            return out

        return self.branches(h, attention, fused)

    def branches(
        self, h: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor], fused: bool
    ) -> torch.Tensor:
        """The hidden stream after both branches, `attention` being this layer's for the step."""
        raise NotImplementedError


class DecoderLayer(ResidualLayer):
    """The pre-norm layer (Llama and most others): h += attention(norm(h)); h += mlp(norm(h)).
    Fused, the residual add and the norm after it run in one Triton kernel."""

    def __init__(self, config: PretrainedConfig, arch: str, layer: int) -> None:
        super().__init__(config, arch, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Granite scales each branch before adding it back (residual + branch * m).
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def branches(
        self, h: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor], fused: bool
    ) -> torch.Tensor:
        m = self.residual_multiplier
        x = attention(self.input_layernorm(h))
        x = x if m == 1.0 else x.mul_(m)  # x is a fresh tensor: in place is safe
        norm = self.post_attention_layernorm
        if fused and norm.fusable(x):
            normed, h = norm.add_forward(x, h)
        else:
            h = x.add_(h)
            normed = norm(h)
        x = self.mlp(normed, fused)
        return (x if m == 1.0 else x.mul_(m)).add_(h)


class PostNormLayer(ResidualLayer):
    """OLMo 2's layer: each branch is normed on its way out, none on its way in:
    h += norm(attention(h)); h += norm(mlp(h)). layers.c runs it too (its post_norm)."""

    def __init__(self, config: PretrainedConfig, arch: str, layer: int) -> None:
        super().__init__(config, arch, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)

    def branches(
        self, h: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor], fused: bool
    ) -> torch.Tensor:
        h = self.post_attention_layernorm(attention(h)).add_(h)  # a norm's output is fresh
        return self.post_feedforward_layernorm(self.mlp(h, fused)).add_(h)


class SandwichNormLayer(ResidualLayer):
    """Gemma 3's layer: each branch is normed on its way in and on its way out, every norm
    scaling by 1 + weight in float32: h += norm(attention(norm(h))); h += norm(mlp(norm(h)))."""

    def __init__(self, config: PretrainedConfig, arch: str, layer: int) -> None:
        super().__init__(config, arch, layer)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, True, 1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, True, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, True, 1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, True, 1.0)

    def branches(
        self, h: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor], fused: bool
    ) -> torch.Tensor:
        x = attention(self.input_layernorm(h))
        h = self.post_attention_layernorm(x).add_(h)  # a norm's output is fresh: in place
        x = self.mlp(self.pre_feedforward_layernorm(h), fused)
        return self.post_feedforward_layernorm(x).add_(h)
