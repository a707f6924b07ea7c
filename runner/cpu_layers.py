"""Every decoder layer of an engine step in one call into the C kernels.

A decode step of a small model spends about a quarter of its time between the kernels: some
fifteen operators a layer, each called from Python on a few rows. `CpuLayers` hands the whole
stack of layers to runner/csrc/layers.c instead, which chains the same kernels (RMSNorm, panel
products, RoPE and the cache write, decode and prefill attention split as
runner/cpu_attention.py splits them, the gated SiLU) in C, in the same order, so the hidden
states come out bit for bit as the module path computes them.

It covers every architecture the model takes (Llama, Mistral, SmolLM2; Qwen2's biases, Qwen3's
q/k norms) once packed for the panel kernel, with widths that are multiples of 16 and within the
decode kernel's head limits. Anything else runs through the modules as before.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from kvcache.store import KVStore
from runner.attention import AttentionMetadata
from runner.cpu_attention import CpuSplit
from runner.cpu_kernel import LANES, CpuKernels, StepSplit
from runner.cpu_linear import PackedLinear
from runner.cpu_panels import weight_type
from runner.decoder_layers import DecoderLayer, PostNormLayer

if TYPE_CHECKING:
    from runner.layers import RMSNorm
    from runner.model import CausalLM

# Steps up to this many tokens keep their scratch for the next step; a longer prefill step's
# (about 30 KB a token for SmolLM2) is freed after it.
KEPT_SCRATCH_ROWS = 256


class CpuLayers:
    """The layers of one packed model, as the pointers layers.c walks. Build with `for_model`;
    ask `takes` each step."""

    def __init__(self, model: CausalLM, kernels: CpuKernels) -> None:
        layers = _layers(model)
        self.kernels = kernels
        self.hidden = model.hidden_size
        self.intermediate = layers[0].mlp.intermediate
        self.num_heads, self.num_kv_heads, self.head_dim = (
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
        )
        self.eps = layers[0].post_attention_layernorm.eps
        self.scale = layers[0].self_attn.scale
        self.residual_multiplier = getattr(layers[0], "residual_multiplier", 1.0)
        # OLMo 2's layers norm each branch on its way out (and q/k across heads); for_model
        # checks that all layers are of one kind. layers.c tells them by their FFN_NORM.
        self.post_norm = isinstance(layers[0], PostNormLayer)
        # Which layers rotate q and k (SmolLM3 leaves RoPE out of some); None: all of them.
        uses = [int(layer.self_attn.use_rope) for layer in layers]
        self._rope_layers = None if all(uses) else (ctypes.c_int * len(uses))(*uses)
        # Each layer's sliding window (0: the whole context; Mistral's in every layer, Qwen2's
        # and Gemma 3's in some); None (NULL): no layer has one.
        windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        self._windows = (ctypes.c_int * len(windows))(*windows) if any(windows) else None
        self.num_layers = len(layers)
        self._query_probe = _query_probe(self.num_heads, self.head_dim)
        # Per layer, in the order of layers.c's enum; None (NULL) where the model has no such
        # tensor. The tensors stay owned by the model; the array only points at them.
        tensors: list[torch.Tensor | None] = []
        # One weight type for every product (for_model checks): panel_gemm.c's WEIGHTS_* code.
        self._weight_type = weight_type(_product(layers[0].mlp.down_proj).packed)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = _product(attn.qkv_proj), _product(attn.o_proj)
            gate_up, down = _product(mlp.gate_up_proj), _product(mlp.down_proj)
            pre = layer if isinstance(layer, DecoderLayer) else None
            post = layer if isinstance(layer, PostNormLayer) else None
            tensors += [
                pre.input_layernorm.weight if pre is not None else None,
                qkv.packed,
                qkv.bias,
                attn.q_norm.weight if attn.q_norm is not None else None,
                attn.k_norm.weight if attn.k_norm is not None else None,
                o.packed,
                o.bias,
                layer.post_attention_layernorm.weight,
                gate_up.packed,
                gate_up.bias,
                down.packed,
                down.bias,
                post.post_feedforward_layernorm.weight if post is not None else None,
            ]
        pointers = [None if t is None else t.data_ptr() for t in tensors]
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)
        self._scratch = torch.empty(0)
        # Wall time spent so far in the products and in the attention kernels, layers.c's
        # seconds[0] and [1] (runner/matmul_timer.py and the step metrics read them).
        self._seconds = (ctypes.c_double * 2)(0.0, 0.0)

    @property
    def product_s(self) -> float:
        return float(self._seconds[0])

    @property
    def attention_s(self) -> float:
        return float(self._seconds[1])

    @classmethod
    def for_model(cls, model: CausalLM, kernels: CpuKernels | None) -> CpuLayers | None:
        """The layers in C where the model fits layers.c, else None."""
        if kernels is None or not model.layers:
            return None
        kinds = {type(layer) for layer in model.layers}
        if kinds not in ({DecoderLayer}, {PostNormLayer}):  # layers.c takes one kind a model
            return None
        layers = _layers(model)
        heads = _query_probe(model.num_heads, model.head_dim)
        one_token_blocks = torch.empty((0, 1, model.num_kv_heads, model.head_dim))
        if not (
            model.hidden_size % LANES == 0
            and layers[0].mlp.intermediate % LANES == 0  # the gated SiLU's vectors
            and kernels.decode_supported(heads, one_token_blocks)  # the attention kernels' heads
        ):
            return None
        eps = {norm.eps for layer in layers for norm in _norms(layer)}
        if len(eps) != 1 or not all(_fits(layer) for layer in layers):
            return None
        types = {weight_type(_product(p).packed) for layer in layers for p in _products(layer)}
        if len(types) != 1:  # layers.c takes one weight type for the whole model
            return None
        return cls(model, kernels)

    def takes(self, kv: KVStore, backend: str) -> bool:
        """Whether steps can run here: the CPU kernels' attention, a contiguous store that the
        decode kernel takes (float32 or float16 on the CPU, its block size), shaped for this model
        (layers.c reads it by raw offsets: a store of other shapes would be read out of
        bounds)."""
        tensor = kv.tensor
        layers, _, _, _, kv_heads, head_dim = tensor.shape
        return (
            backend == "cpu"
            and (layers, kv_heads, head_dim) == (self.num_layers, self.num_kv_heads, self.head_dim)
            and tensor.is_contiguous()
            and self.kernels.decode_supported(self._query_probe, tensor[0, 0])
        )

    def run(
        self,
        h: torch.Tensor,  # [T, H] embeddings of the step's tokens
        cos: torch.Tensor,  # [T, R] by position (R = rotary dims, at most D)
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStore,
    ) -> torch.Tensor:
        """Hidden states after the last layer, [T, H] (before the final norm); writes every
        layer's K/V of the T tokens. Check `takes` first."""
        rows = h.shape[0]
        group = self.num_heads // self.num_kv_heads
        split = CpuSplit.for_step(meta, True, group, kv.block_size)
        h = h.contiguous().clone()  # updated in place by every layer
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        shape = (rows, self.hidden, self.intermediate, self.num_heads, self.num_kv_heads)
        need = self.kernels.layers_scratch(*shape, self.head_dim)
        scratch = self._scratch
        if scratch.numel() < need:
            scratch = torch.empty(need, dtype=torch.float32)
            if rows <= KEPT_SCRATCH_ROWS:
                self._scratch = scratch
        status = self.kernels.run_layers(
            h.data_ptr(),
            *shape,
            self.head_dim,
            self._weights,
            self.num_layers,
            kv.tensor.data_ptr(),
            kv.tensor[0, 0].numel(),  # elements of one layer's keys (or values)
            kv.block_size,
            ctypes.byref(_step_split(split)),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[1],  # rotary dims: fewer than head_dim with partial rotary
            self._rope_layers,
            self._windows,
            slots.data_ptr(),
            self.eps,
            self.scale,
            self.residual_multiplier,
            scratch.data_ptr(),
            self._seconds,
            self._weight_type,
            kv.tensor.dtype == torch.float16,
        )
        if status != 0:
            raise RuntimeError("run_layers: an attention kernel refused the step")
        return h


def _step_split(split: CpuSplit) -> StepSplit:
    """The C view of `split`; its tensors are contiguous (CpuSplit.of makes them so)."""
    out = StepSplit()
    if split.decodes is not None:
        rows, tables, contexts = split.decodes
        out.num_decodes = rows.numel()
        out.decode_rows = rows.data_ptr()
        out.decode_tables = tables.data_ptr()
        out.decode_max_blocks = tables.shape[1]
        out.decode_lens = contexts.data_ptr()
        out.shared_blocks = split.shared_blocks
    if split.longer is not None:
        tables, starts, lens, contexts = split.longer
        out.num_longer = lens.numel()
        out.longer_tables = tables.data_ptr()
        out.longer_max_blocks = tables.shape[1]
        out.longer_starts = starts.data_ptr()
        out.longer_lens = lens.data_ptr()
        out.longer_contexts = contexts.data_ptr()
    return out


def _query_probe(num_heads: int, head_dim: int) -> torch.Tensor:
    """An empty float32 CPU q of the model's heads: the kernels' support checks read shapes,
    dtypes and devices only, and this asks them about the model's queries."""
    return torch.empty((0, num_heads, head_dim))


Layer = DecoderLayer | PostNormLayer


def _layers(model: CausalLM) -> list[Layer]:
    return [cast(Layer, layer) for layer in model.layers]


def _norms(layer: Layer) -> list[RMSNorm]:
    attn = layer.self_attn
    qk = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if isinstance(layer, PostNormLayer):
        return [layer.post_attention_layernorm, layer.post_feedforward_layernorm, *qk]
    return [layer.input_layernorm, layer.post_attention_layernorm, *qk]


def _product(module: torch.nn.Module) -> PackedLinear:
    return cast(PackedLinear, module)


def _products(layer: Layer) -> list[torch.nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _fits(layer: Layer) -> bool:
    """A layer packed for the panel kernel, every product's width a whole number of panels
    (layers.c reads the outputs unpadded), q and k normed both or neither."""
    attn = layer.self_attn
    return (
        (attn.q_norm is None) == (attn.k_norm is None)
        and all(
            isinstance(p, PackedLinear)
            and p.backend == "panel"
            and p.out_features % LANES == 0
            and (p.bias is None or (p.bias.dtype == torch.float32 and p.bias.is_contiguous()))
            for p in _products(layer)
        )
        and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in _norms(layer))
    )
