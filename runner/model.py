"""Llama-family decoder over flat (varlen) token batches: no padding, no batch dim.

One class covers every architecture of runner/architectures.py; its layers are
runner/decoder_layers.py's. Projections are fused (one Linear for q/k/v, one for gate/up) so a
layer runs four matmuls; load_hf_state_dict() maps HF's separate tensors into the fused ones.
K/V live in a KVStore and are read through paged_attention().
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.store import KVStore
from runner.architectures import POST_NORM_ARCHITECTURES, resolve_architecture
from runner.attention import AttentionMetadata
from runner.cpu_linear import PackedLinear
from runner.decoder_layers import Attention, DecoderLayer, PostNormLayer
from runner.hf_weights import load_hf_weights
from runner.layers import RMSNorm, rope_cos_sin

if TYPE_CHECKING:
    from runner.cpu_layers import CpuLayers


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
