"""Llama-family decoder over flat (varlen) token batches: no padding, no batch dim.

One class covers every architecture of runner/model/architectures.py; its layers are
runner/model/decoder_layers.py's. Projections are fused (one Linear for q/k/v, one for gate/up) so a
layer runs four matmuls; load_hf_state_dict() maps HF's separate tensors into the fused ones.
K/V live in a KVStore and are read through paged_attention().
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.linear import PackedLinear
from runner.backends.torch.backend import TORCH_ATTENTION
from runner.kv_pool.store import KVStore
from runner.model.architectures import (
    GEMMA_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    resolve_architecture,
)
from runner.model.decoder_layers import Attention, DecoderLayer, PostNormLayer, SandwichNormLayer
from runner.model.hf_weights import load_hf_weights
from runner.model.layers import RMSNorm, rope_cos_sin
from runner.model.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Per layer type with RoPE tables of its own: the (cos, sin) rows of a step's positions.
RopeRows = dict[str, tuple[torch.Tensor, torch.Tensor]]


class CausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.architecture = resolve_architecture(config)
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        gemma = self.architecture in GEMMA_ARCHITECTURES
        # Granite: embeddings scaled up, logits scaled down (1 elsewhere). Gemma scales its
        # embeddings by sqrt(hidden_size), rounded to the weights' dtype as transformers does.
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        if gemma:
            self.embedding_multiplier = config.hidden_size**0.5
        self.round_embedding_multiplier = gemma
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
        # cap * tanh(logits / cap) where the config sets a final soft cap (Gemma 2's 30).
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.head_s = 0.0  # seconds in compute_logits so far
        # Tensor parallel (runner/model/sharding.py): this rank's share of the vocabulary, the
        # widths of every rank's, and the group the head's logits are gathered over.
        self.tp: TensorParallel | None = None
        self.vocab_widths: list[int] = [config.vocab_size]
        # Whether this rank's KV heads count in a sum over all of them (a KV head replicated
        # on several ranks counts on the first alone).
        self.counts_kv = True
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_class = (
            SandwichNormLayer
            if gemma
            else PostNormLayer
            if self.architecture in POST_NORM_ARCHITECTURES
            else DecoderLayer
        )
        self.layers = nn.ModuleList(
            layer_class(config, self.architecture, i) for i in range(self.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma, 1.0 if gemma else 0.0)
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
        # Each layer's RoPE settings, as its attention reads them (None: rope_cos / rope_sin),
        # and the tables of the layer types with settings of their own (Gemma 3's local layers).
        attns: list[Attention] = [layer.self_attn for layer in self.layers]  # type: ignore[misc]
        self.layer_rope_types = [a.rope_type for a in attns]
        self.rope_by_type: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.embed_tokens.weight.device.type != "meta":
            self.init_rope_cache()

    def init_rope_cache(self, max_positions: int | None = None) -> None:
        """(Re)compute the cos/sin tables on the weights' device and dtype; call after
        ``to_empty()`` (a meta-built model has no tables yet). `max_positions`: the rows the
        tables hold, at most the model's positions (None: all of them). The engine passes its
        context: a config may declare millions of positions (or 2^40), whose tables would
        take gigabytes or fail to allocate, where the context reads a few thousand rows."""
        w = self.embed_tokens.weight
        rows = self.max_position_embeddings
        if max_positions is not None:
            if max_positions < 1:
                raise ValueError(f"max_positions={max_positions}: a RoPE table needs a row")
            rows = min(rows, max_positions)
        self.rope_cos, self.rope_sin = rope_cos_sin(
            self.config, self.head_dim, rows, w.dtype, w.device
        )
        self.rope_by_type = {
            kind: rope_cos_sin(self.config, self.head_dim, rows, w.dtype, w.device, kind)
            for kind in {k for k in self.layer_rope_types if k is not None}
        }

    def keep_rope_positions(self, positions: int) -> None:
        """Keep only the first `positions` rows of the RoPE tables: the engine's context, where
        the model's positions may run far past it (Gemma 3 4B's two tables of 131,072 x 256
        floats each hold 0.5 GB, of which an 8,192-token context reads 3%)."""
        self.rope_cos = self.rope_cos[:positions].clone()
        self.rope_sin = self.rope_sin[:positions].clone()
        self.rope_by_type = {
            kind: (cos[:positions].clone(), sin[:positions].clone())
            for kind, (cos, sin) in self.rope_by_type.items()
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input [T, H]: the tokens' embeddings, scaled as the model asks."""
        h = self.embed_tokens(input_ids)  # [T, H]
        if self.round_embedding_multiplier:
            return h * torch.tensor(self.embedding_multiplier, dtype=h.dtype)
        if self.embedding_multiplier != 1.0:
            return h * self.embedding_multiplier
        return h

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RopeRows]:
        """The RoPE rows of these positions: the default tables' (cos, sin) [T, D] and those
        of each layer type with tables of its own."""
        cos = self.rope_cos.index_select(0, positions)  # [T, D]
        sin = self.rope_sin.index_select(0, positions)
        by_type = {  # [T, D] each, per layer type with its own tables
            kind: (c.index_select(0, positions), s.index_select(0, positions))
            for kind, (c, s) in self.rope_by_type.items()
        }
        return cos, sin, by_type

    def layer_rope(
        self, i: int, cos: torch.Tensor, sin: torch.Tensor, by_type: RopeRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows layer i rotates with, out of `rope_rows`' result."""
        kind = self.layer_rope_types[i]
        return (cos, sin) if kind is None else by_type[kind]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: KVStore,
        attention: AttentionBackend = TORCH_ATTENTION,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, H]; writes K/V of all T tokens, through the
        engine's attention backend (and its layer stack, where it takes this cache)."""
        cos, sin, by_type = self.rope_rows(positions)
        h = self.run_layers(self.embed(input_ids), cos, sin, by_type, meta, kv, attention)
        out: torch.Tensor = self.norm(h)
        return out

    def run_layers(
        self,
        h: torch.Tensor,  # [T, H] the first layer's input
        cos: torch.Tensor,  # [T, D] the tokens' rows of rope_rows
        sin: torch.Tensor,
        by_type: RopeRows,
        meta: AttentionMetadata,
        kv: KVStore,
        attention: AttentionBackend,
        span: range | None = None,
    ) -> torch.Tensor:
        """The hidden states after the layers of `span` (None: all), before the final norm;
        writes those layers' K/V of the T tokens: in one call of the backend's layer stack
        where it takes this cache, else layer by layer."""
        stack = attention.layers
        if stack is not None and stack.takes(kv):
            return stack.run(h, cos, sin, meta, kv, by_type, span)
        # On a GPU the Triton backend's steps also fuse the layers' elementwise work
        # (runner/backends/triton/fused_elementwise.py): fewer kernels a step.
        # RoPE and the K/V store run in one kernel too (rope_store.py), then the attention
        # without its store.
        fused = attention.capabilities.fuses_rope_store and h.is_cuda
        stored = attention.attend_stored if fused else None
        for i in range(self.num_layers) if span is None else span:
            k_cache, v_cache = kv.layer(i)
            c, s = self.layer_rope(i, cos, sin, by_type)
            h = self.layers[i](h, c, s, meta, k_cache, v_cache, attention.attend, fused, stored)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (only the rows that need sampling) -> logits [N, vocab] float32. Its
        wall time adds to `head_s` (runner/engine/step/metrics.py; on a GPU only the launch)."""
        start = time.perf_counter()
        head = self.lm_head
        logits = F.linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)
        self.head_s += time.perf_counter() - start
        if self.tp is not None:  # every rank's slice of the vocabulary, on rank 0
            gathered = self.tp.gather_columns(logits, self.vocab_widths)
            if gathered is None:  # another rank: rank 0 samples
                return logits.new_empty((logits.shape[0], 0), dtype=torch.float32)
            logits = gathered
        logits = logits.float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        """Copy HF-named tensors into our (fused) parameters (runner/model/hf_weights.py)."""
        load_hf_weights(self, state, self._qkv_sizes)
