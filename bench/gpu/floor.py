"""The memory floor of decoding: the bytes a decode step must read (every weight once, every
sequence's K/V, a shared prefix once per chunk where the Triton decode reads it so), and the
time those bytes take at the device's bandwidth. A decode step is bound by memory, so its time
over this floor says how far the engine is from the best the chip allows.

Counted, not measured: the weights from the checkpoint's tensors (the input embedding's matrix
only where the LM head is another one: a lookup reads a row a token), the K/V from the context
lengths (runner/backends/triton/shared_prefix.py: decode_kv_bytes). Activations, the logits and
the sampler are left out: they are small beside these at the bench's sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from bench.workloads import BenchRequest
from runner.backends.torch.cascade import PrefixGroup
from runner.backends.triton.shared_prefix import (
    KVBytes,
    build_shared_prefix_plan,
    decode_kv_bytes,
    members_per_chunk,
)

H200_BYTES_PER_S = 4.8e12  # HBM3e, NVIDIA's figure


class ModelBytes(NamedTuple):
    weights: int  # bytes of weights a decode step reads
    kv_per_token: int  # K and V of every KV head of one token in one layer
    num_layers: int
    gqa: int  # query heads per KV head


def model_bytes(folder: Path, dtype: torch.dtype) -> ModelBytes:
    """What one decode step of the model saved in `folder` (config.json and safetensors files)
    reads per weight and per cached token, its weights and K/V cache in `dtype`. Counted from
    the checkpoint, where every weight is a tensor of its own (the loaded model may pack them)."""
    config = json.loads((folder / "config.json").read_text())
    sizes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sizes[name] = math.prod(f.get_slice(name).get_shape())
    elements = sum(sizes.values())
    if any(name.endswith("lm_head.weight") for name in sizes):
        # The input embedding is looked up (a row a token), not read; the LM head is.
        elements -= sum(n for name, n in sizes.items() if name.endswith("embed_tokens.weight"))
    elt = torch.empty((), dtype=dtype).element_size()
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    per_token = 2 * kv_heads * head_dim * elt
    return ModelBytes(
        elements * elt, per_token, int(config["num_hidden_layers"]), heads // kv_heads
    )


def decode_floor(
    requests: list[BenchRequest], sizes: ModelBytes, decode_steps: int, bytes_per_s: float
) -> dict[str, float]:
    """The floor of a run's decode: the first output token comes from the prefill, and each
    later one from a decode that feeds the one before it, so output token i + 1 reads the K/V of
    prompt + i tokens in every layer; each of the run's `decode_steps` reads the weights once."""
    tokens = sum(sum(len(r.prompt_token_ids) + i for i in range(1, r.max_tokens)) for r in requests)
    kv = tokens * sizes.kv_per_token * sizes.num_layers
    weights = decode_steps * sizes.weights
    return {
        "kv_bytes": kv,
        "weight_bytes": weights,
        "bytes_per_s": bytes_per_s,
        "floor_s": (kv + weights) / bytes_per_s,
    }


def shared_prefix_step_bytes(
    prefix_len: int,
    contexts: list[int],
    sizes: ModelBytes,
    block_size: int,
    kv_dtype: torch.dtype,
) -> KVBytes:
    """K/V bytes of one decode step of sequences at `contexts` that all share their first
    `prefix_len` tokens (whole blocks of them), read plainly and with the prefix read once per
    chunk, as the Triton decode's plan would chunk them."""
    blocks = list(range(prefix_len // block_size))
    group = PrefixGroup(list(range(len(contexts))), blocks)
    members = members_per_chunk(sizes.gqa, kv_dtype)
    plan = build_shared_prefix_plan([group], len(contexts), block_size, members, "cpu")
    return decode_kv_bytes(contexts, plan, sizes.kv_per_token, sizes.num_layers)
