"""Every decoder layer of an engine step in one call into the C kernels.

A decode step of a small model spends about a quarter of its time between the kernels: some
fifteen operators a layer, each called from Python on a few rows. `CpuLayers` hands the whole
stack of layers to runner/backends/cpu/csrc/layers.c instead, which chains the same kernels
(RMSNorm, panel products, RoPE and the cache write, decode and prefill attention split as
runner/backends/cpu/attention.py splits them, the gated SiLU or GeLU) in C, in the same order, so
the hidden states come out bit for bit as the module path computes them.

It covers every architecture the model takes (Llama, Mistral, SmolLM2; Qwen2's biases, Qwen3's
q/k norms; OLMo 2's post-norm and Gemma 3's sandwich layers) once packed for the panel kernel,
with widths that are multiples of 16 and within the decode kernel's head limits. Anything else
runs through the modules as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.abi import step_split
from runner.backends.cpu.kernel import LANES, CpuKernels
from runner.backends.cpu.linear import PackedLinear
from runner.backends.cpu.panels import weight_type
from runner.backends.cpu.split import CpuSplit
from runner.kv_pool.store import KVStore
from runner.model.decoder_layers import DecoderLayer, PostNormLayer, SandwichNormLayer
from runner.model.layers import RMSNorm

if TYPE_CHECKING:
    from runner.model.decoder import CausalLM

# Steps up to this many tokens keep their scratch for the next step; a longer prefill step's
# (about 30 KB a token for SmolLM2) is freed after it.
KEPT_SCRATCH_ROWS = 256
# The layouts layers.c runs, one a model; it tells them apart by the norms a layer has.
LAYOUTS = ({DecoderLayer}, {PostNormLayer}, {SandwichNormLayer})
# RoPE tables layers.c reads a step: a model's one, or Gemma 3's two (local and global layers).
MAX_ROPE_TABLES = 2
# Sizes of the entries of the per-layer arrays layers.c reads (weights, RoPE tables, windows).
POINTER_BYTES, INT_BYTES = ctypes.sizeof(ctypes.c_void_p), ctypes.sizeof(ctypes.c_int)


class CpuLayers:
    """The layers of one packed model, as the pointers layers.c walks. Build with `for_model`;
    ask `takes` each step."""

    def __init__(self, model: CausalLM, kernels: CpuKernels, batch_invariant: bool = False) -> None:
        layers = _layers(model)
        self.kernels = kernels
        # Batch-invariant steps (EngineConfig.deterministic): every sequence attends through
        # the prefill kernel's tile (runner/backends/cpu/split.py CpuSplit.for_step).
        self.batch_invariant = batch_invariant
        self.hidden = model.hidden_size
        self.intermediate = layers[0].mlp.intermediate
        self.num_heads, self.num_kv_heads = model.num_heads, model.num_kv_heads
        self.head_dim = model.head_dim
        self.eps = layers[0].post_attention_layernorm.eps
        self.scale = layers[0].self_attn.scale
        # Gemma 2's attention logit soft cap, one for the model (for_model checks); None: none.
        self.softcap: float | None = _softcap(layers[0])
        self.residual_multiplier = getattr(layers[0], "residual_multiplier", 1.0)
        # OLMo 2's layers norm each branch on its way out, not in (for_model: all of one kind).
        self.post_norm = isinstance(layers[0], PostNormLayer)
        # Gemma's MLP gates with the tanh GeLU, the others' with SiLU (for_model: all alike).
        self.gelu = layers[0].mlp.activation == "gelu_pytorch_tanh"
        # The RoPE tables a step reads, by layer type (None: the model's rope_cos / rope_sin),
        # in order of first use, and each layer's in layers.c's terms: 1 + its index here, or 0
        # where the layer rotates nothing (SmolLM3 leaves RoPE out of some); None (NULL): every
        # layer rotates with the first.
        self._rope_kinds = _rope_kinds(layers)
        tables = [
            1 + self._rope_kinds.index(layer.self_attn.rope_type) if layer.self_attn.use_rope else 0
            for layer in layers
        ]
        self._rope_layers = None if set(tables) == {1} else (ctypes.c_int * len(tables))(*tables)
        # Each layer's sliding window (0: the whole context; Mistral's in every layer, Qwen2's
        # and Gemma 3's in some); None (NULL): no layer has one.
        windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        self._windows = (ctypes.c_int * len(windows))(*windows) if any(windows) else None
        self.num_layers = len(layers)
        self._query_probe = _query_probe(self.num_heads, self.head_dim)
        # Per layer, in the order of layers.c's enum; None (NULL) where the layer has no such
        # tensor (which norms are set tells layers.c the layout). The norms' are what they scale
        # by: Gemma's 1 + weight is computed once here and kept alive by self._tensors.
        tensors: list[torch.Tensor | None] = []
        # One weight type for every product (for_model checks): panel_gemm.c's WEIGHTS_* code.
        self._weight_type = weight_type(_product(layers[0].mlp.down_proj).packed)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = _product(attn.qkv_proj), _product(attn.o_proj)
            gate_up, down = _product(mlp.gate_up_proj), _product(mlp.down_proj)
            tensors += [
                _scale(getattr(layer, "input_layernorm", None)),  # all but OLMo 2's
                qkv.packed,
                qkv.bias,
                _scale(attn.q_norm),
                _scale(attn.k_norm),
                o.packed,
                o.bias,
                _scale(layer.post_attention_layernorm),
                gate_up.packed,
                gate_up.bias,
                down.packed,
                down.bias,
                _scale(getattr(layer, "post_feedforward_layernorm", None)),  # OLMo 2's, Gemma's
                _scale(getattr(layer, "pre_feedforward_layernorm", None)),  # Gemma 3's
            ]
        self._tensors = tensors
        pointers = [None if t is None else t.data_ptr() for t in tensors]
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)
        self._scratch = torch.empty(0)
        # Wall time spent so far in the products and in the attention kernels, layers.c's
        # seconds[0] and [1] (bench/matmul_timer.py and the step metrics read them).
        self._seconds = (ctypes.c_double * 2)(0.0, 0.0)

    @property
    def product_s(self) -> float:
        return float(self._seconds[0])

    @property
    def attention_s(self) -> float:
        return float(self._seconds[1])

    @classmethod
    def for_model(
        cls, model: CausalLM, kernels: CpuKernels | None, batch_invariant: bool = False
    ) -> CpuLayers | None:
        """The layers in C where the model fits layers.c, else None (`batch_invariant`: see
        __init__)."""
        if kernels is None or not model.layers:
            return None
        kinds = {type(layer) for layer in model.layers}
        if kinds not in LAYOUTS:  # layers.c takes one kind a model
            return None
        layers = _layers(model)
        heads = _query_probe(model.num_heads, model.head_dim)
        one_token_blocks = torch.empty((0, 1, model.num_kv_heads, model.head_dim))
        widths = {t.shape[-1] for ts in model.rope_by_type.values() for t in ts}
        if not (
            model.hidden_size % LANES == 0
            and layers[0].mlp.intermediate % LANES == 0  # the gated activation's vectors
            and kernels.decode_supported(heads, one_token_blocks)  # the attention kernels' heads
            and len({layer.mlp.activation for layer in layers}) == 1  # one flag for the model
            and len(_rope_kinds(layers)) <= MAX_ROPE_TABLES
            and widths <= {model.rope_cos.shape[-1]}  # one rotary width for every table
        ):
            return None
        eps = {norm.eps for layer in layers for norm in _norms(layer)}
        if len(eps) != 1 or not all(_fits(layer) for layer in layers):
            return None
        types = {weight_type(_product(p).packed) for layer in layers for p in _products(layer)}
        if len(types) != 1:  # layers.c takes one weight type for the whole model
            return None
        if len({_softcap(layer) for layer in layers}) != 1:  # and one soft cap
            return None
        return cls(model, kernels, batch_invariant)

    def takes(self, kv: KVStore) -> bool:
        """Whether steps can run here: a contiguous store that the decode kernel takes (float32
        or float16 on the CPU, its block size), shaped for this model (layers.c reads it by raw
        offsets: a store of other shapes would be read out of bounds)."""
        tensor = kv.tensor
        layers, _, _, _, kv_heads, head_dim = tensor.shape
        return (
            (layers, kv_heads, head_dim) == (self.num_layers, self.num_kv_heads, self.head_dim)
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
        rope_by_type: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        layers: range | None = None,
    ) -> torch.Tensor:
        """Hidden states after the last layer, [T, H] (before the final norm); writes every
        layer's K/V of the T tokens. `rope_by_type`: cos and sin [T, R] of the layer types with
        tables of their own (CausalLM.rope_by_type, gathered by position), where the model has
        any. `layers`: only these consecutive layers, `h` being the input of the first (a blend
        runs its rows through part of the stack); None: all. Check `takes` first."""
        span = range(self.num_layers) if layers is None else layers
        if not (span.step == 1 and 0 <= span.start and span.stop <= self.num_layers):
            raise ValueError(f"layers {span} are not consecutive layers of {self.num_layers}")
        if not span:
            return h
        rows = h.shape[0]
        group = self.num_heads // self.num_kv_heads
        split = CpuSplit.for_step(meta, True, group, kv.block_size, self.batch_invariant)
        h = h.contiguous().clone()  # updated in place by every layer
        by_type = rope_by_type or {}
        tables = [  # layers.c's table 1, and 2 where the layers rotate with two
            tuple(t.contiguous() for t in ((cos, sin) if kind is None else by_type[kind]))
            for kind in self._rope_kinds
        ]
        cos, sin = tables[0]
        cos2, sin2 = tables[1] if len(tables) > 1 else (None, None)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        shape = (rows, self.hidden, self.intermediate, self.num_heads, self.num_kv_heads)
        need = self.kernels.layers_scratch(*shape, self.head_dim)
        scratch = self._scratch
        if scratch.numel() < need:
            scratch = torch.empty(need, dtype=torch.float32)
            if rows <= KEPT_SCRATCH_ROWS:
                self._scratch = scratch
        first = span.start
        per_layer = len(self._weights) // self.num_layers
        # The arrays layers.c reads per layer, from the first layer run: pointers into them.
        weights = ctypes.addressof(self._weights) + first * per_layer * POINTER_BYTES
        rope_layers, windows = (
            None if table is None else ctypes.addressof(table) + first * INT_BYTES
            for table in (self._rope_layers, self._windows)
        )
        status = self.kernels.run_layers(
            h.data_ptr(),
            *shape,
            self.head_dim,
            weights,
            len(span),
            kv.tensor[first].data_ptr(),
            kv.tensor[0, 0].numel(),  # elements of one layer's keys (or values)
            kv.block_size,
            ctypes.byref(step_split(split)),
            cos.data_ptr(),
            sin.data_ptr(),
            None if cos2 is None else cos2.data_ptr(),
            None if sin2 is None else sin2.data_ptr(),
            cos.shape[1],  # rotary dims: fewer than head_dim with partial rotary
            rope_layers,
            windows,
            slots.data_ptr(),
            self.eps,
            self.scale,
            0.0 if self.softcap is None else self.softcap,  # layers.c's 0: no cap
            self.residual_multiplier,
            scratch.data_ptr(),
            self._seconds,
            self._weight_type,
            kv.tensor.dtype == torch.float16,
            self.gelu,
        )
        if status != 0:
            raise RuntimeError("run_layers: an attention kernel refused the step")
        return h


def _query_probe(num_heads: int, head_dim: int) -> torch.Tensor:
    """An empty float32 CPU q of the model's heads: the kernels' support checks read shapes,
    dtypes and devices only, and this asks them about the model's queries."""
    return torch.empty((0, num_heads, head_dim))


Layer = DecoderLayer | PostNormLayer | SandwichNormLayer


def _layers(model: CausalLM) -> list[Layer]:
    return [cast(Layer, layer) for layer in model.layers]


def _norms(layer: Layer) -> list[RMSNorm]:
    """Every norm of the layer, whatever its layout: around its branches, and q/k's."""
    return [module for module in layer.modules() if isinstance(module, RMSNorm)]


def _scale(norm: RMSNorm | None) -> torch.Tensor | None:
    """What layers.c multiplies a norm's rows by (None: no such norm): its weight, or Gemma's
    1 + weight in a tensor of its own (what RMSNorm.forward hands the kernel)."""
    return None if norm is None else norm.scale().detach().contiguous()


def _softcap(layer: Layer) -> float | None:
    """The layer's attention logit soft cap (None: scores uncapped)."""
    # getattr: the attribute is Gemma 2's, read where runner/model/decoder_layers.py sets it
    cap: float | None = getattr(layer.self_attn, "softcap", None)
    return cap


def _rope_kinds(layers: list[Layer]) -> list[str | None]:
    """The layer types whose RoPE tables the rotating layers use, in order of first use (None:
    the model's own table); at least one."""
    kinds: list[str | None] = []
    for layer in layers:
        kind = layer.self_attn.rope_type
        if layer.self_attn.use_rope and kind not in kinds:
            kinds.append(kind)
    return kinds or [None]


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
