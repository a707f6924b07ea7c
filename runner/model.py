"""Llama-family decoder over flat (varlen) token batches: no padding, no batch dim.

One class covers Llama / Mistral / SmolLM2 (Llama), Qwen2 (q/k/v bias) and Qwen3
(per-head RMSNorm on q and k). Projections are fused (one Linear for q/k/v, one for
gate/up) so a layer runs four matmuls; load_hf_state_dict() maps HF's separate tensors
into the fused ones. K/V live in a KVStore and are read through paged_attention().
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.store import KVStore
from runner.attention import AttentionMetadata, paged_attention
from runner.cpu_kernel import CpuKernels
from runner.cpu_linear import PackedLinear
from runner.hf_weights import load_hf_weights
from runner.layers import RMSNorm, apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from runner.cpu_layers import CpuLayers

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


class Attention(nn.Module):
    def __init__(self, config: Any, arch: str, layer: int) -> None:
        super().__init__()
        # SmolLM3 leaves RoPE out of some layers (no_rope_layers[i] == 0: no rotation there).
        self.use_rope = bool((getattr(config, "no_rope_layers", None) or [1] * (layer + 1))[layer])
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
        # Granite sets the attention's scale itself; everyone else scales by 1/sqrt(head_dim).
        self.scale = float(getattr(config, "attention_multiplier", None) or self.head_dim**-0.5)
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
        olmo = not self.qk_norm_per_head
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps, olmo) if qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps, olmo) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [blocks, B, Hkv, D]
        v_cache: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm_per_head:  # Qwen3: norm per head, before RoPE
                q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
                k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            else:  # OLMo 2: norm across all heads, before RoPE
                q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
                k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        else:
            # q and k heads side by side rotate in one pass: [T, Hq + Hkv, D], then split.
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
            q, k = self._rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, backend)  # [T, Hq, D]
        out: torch.Tensor = self.o_proj(o.reshape(t, self.q_size))
        return out

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin) if self.use_rope else x


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)
        # The CPU kernels, once the model is packed for them: silu and the product in one pass.
        self.kernels: CpuKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.kernels is not None and self.kernels.rowwise_supported(gate_up, self.intermediate):
            act = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
            act = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(act)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, arch: str, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Granite scales each branch before adding it back (residual + branch * m).
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        m = self.residual_multiplier
        x = self.self_attn(self.input_layernorm(h), cos, sin, meta, k_cache, v_cache, backend)
        h = (x if m == 1.0 else x.mul_(m)).add_(h)  # x is a fresh tensor: in place is safe
        x = self.mlp(self.post_attention_layernorm(h))
        return (x if m == 1.0 else x.mul_(m)).add_(h)


class PostNormLayer(nn.Module):
    """OLMo 2's layer: each branch is normed on its way out, none on its way in:
    h += norm(attention(h)); h += norm(mlp(h)). (runner/cpu_layers.py runs only DecoderLayer
    models in C: these run module by module, on the same C kernels.)"""

    def __init__(self, config: Any, arch: str, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, layer)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        x = self.self_attn(h, cos, sin, meta, k_cache, v_cache, backend)
        h = self.post_attention_layernorm(x).add_(h)  # a norm's output is fresh: in place
        return self.post_feedforward_layernorm(self.mlp(h)).add_(h)


class CausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.architecture = resolve_architecture(config)
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Granite: embeddings scaled up, logits scaled down (1 elsewhere).
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
        # "torch", "cpu" or "triton"; the engine may switch it after loading.
        self.attention_backend = "torch"
        # A step's layers in one C call, once the model is packed for the CPU kernels.
        self.cpu_layers: CpuLayers | None = None
        self.head_s = 0.0  # seconds in compute_logits so far
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            (PostNormLayer if self.architecture in POST_NORM_ARCHITECTURES else DecoderLayer)(
                config, self.architecture, i
            )
            for i in range(self.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (
            None
            if self.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        attn: Attention = self.layers[0].self_attn  # type: ignore[assignment]
        self.num_heads: int = attn.num_heads
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        self._qkv_sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.embed_tokens.weight.device.type != "meta":
            self.init_rope_cache()

    def init_rope_cache(self) -> None:
        """(Re)compute the cos/sin tables on the weights' device and dtype; call after
        ``to_empty()`` (a meta-built model has no tables yet)."""
        w = self.embed_tokens.weight
        self.rope_cos, self.rope_sin = rope_cos_sin(
            self.config, self.head_dim, self.max_position_embeddings, w.dtype, w.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: KVStore,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, H]; writes K/V of all T tokens."""
        h = self.embed_tokens(input_ids)  # [T, H]
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        cos = self.rope_cos.index_select(0, positions)  # [T, D]
        sin = self.rope_sin.index_select(0, positions)
        if self.cpu_layers is not None and self.cpu_layers.takes(kv, self.attention_backend):
            h = self.cpu_layers.run(h, cos, sin, meta, kv)
        else:
            for i, layer in enumerate(self.layers):
                k_cache, v_cache = kv.layer(i)
                h = layer(h, cos, sin, meta, k_cache, v_cache, self.attention_backend)
        out: torch.Tensor = self.norm(h)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (only the rows that need sampling) -> logits [N, vocab] float32. Its
        wall time adds to `head_s` (runner/step_clock.py; on a GPU only the launch)."""
        start = time.perf_counter()
        head = self.lm_head
        logits = F.linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)
        self.head_s += time.perf_counter() - start
        logits = logits.float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def num_matmul_params(self, include_head: bool = True) -> int:
        """Weights that take part in a token's matrix products: the projections, and the head
        unless `include_head` is False (a prompt runs it for its last token only)."""
        total = sum(
            m.in_features * m.out_features
            for name, m in self.named_modules()
            if isinstance(m, nn.Linear | PackedLinear) and name != "lm_head"
        )
        return total + (self.vocab_size * self.hidden_size if include_head else 0)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into our (fused) parameters (runner/hf_weights.py)."""
        load_hf_weights(self, state, self._qkv_sizes)
