"""Hugging Face tensor names -> the fused parameters of runner/model/decoder.py: q/k/v into one
qkv_proj, gate/up into one gate_up_proj (Phi-3 stores both fused already), a tied head
skipped. Tensors are read one at a time, so the state may be a lazy mapping over files."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

FUSED_ON_DISK = -1  # the part of a checkpoint tensor that fills a fused parameter whole
# A multimodal checkpoint's text model (runner/model/architectures.py TEXT_OF_MULTIMODAL) sits under
# these prefixes (the hub's files and transformers 5's own names); its other towers are skipped.
_TEXT_PREFIXES = {
    "language_model.model.": "",
    "model.language_model.": "",
    "language_model.lm_head.": "lm_head.",
}
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.")
# HF name fragment -> (ours, part of the fused parameter it fills)
_SPLIT = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", 1),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", 2),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


def load_hf_weights(
    model: nn.Module, state: Mapping[str, torch.Tensor], qkv_sizes: list[int]
) -> None:
    """Copy `state` into `model`'s parameters, converting dtype and device. qkv_sizes: the
    rows of q, k and v in a qkv_proj. Raises ValueError on an unknown name, a shape mismatch
    or a missing tensor."""
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    parts_needed = {
        n: 3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1 for n in params
    }
    parts_done: dict[str, set[int]] = {n: set() for n in params}
    for hf_name in state.keys():
        target = _map_name(hf_name, tied)
        if target is None:
            continue
        name, part = target
        if name not in params:
            arch = getattr(model, "architecture", type(model).__name__)
            raise ValueError(f"unexpected weight {hf_name!r} for {arch}")
        whole = part == FUSED_ON_DISK
        dest = params[name].data if whole else _part_view(params[name].data, name, part, qkv_sizes)
        tensor = state[hf_name]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        parts_done[name].update(range(parts_needed[name]) if whole else (part,))
    missing = [n for n, k in parts_needed.items() if len(parts_done[n]) != k]
    if missing:
        raise ValueError(f"weights missing for {len(missing)} parameters, e.g. {missing[:3]}")


def _map_name(hf_name: str, tied: bool) -> tuple[str, int] | None:
    """HF name -> (our parameter, part index in a fused tensor); None = ignore."""
    for prefix, ours in _TEXT_PREFIXES.items():
        if hf_name.startswith(prefix):
            hf_name = ours + hf_name.removeprefix(prefix)
            break
    if hf_name.removeprefix("model.").startswith(_OTHER_TOWERS):
        return None
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and tied:
        return None  # tied: the embedding is the head
    for hf, ours, part in _SPLIT:
        if hf in name:
            return name.replace(hf, ours), part
    if ".qkv_proj." in name or ".gate_up_proj." in name:  # Phi-3 stores them fused
        return name, FUSED_ON_DISK
    return name, 0


def _part_view(data: torch.Tensor, name: str, part: int, qkv_sizes: list[int]) -> torch.Tensor:
    """The rows of a fused parameter that HF tensor `part` fills."""
    if ".qkv_proj." in name:
        sizes = qkv_sizes
    elif ".gate_up_proj." in name:
        sizes = [data.shape[0] // 2] * 2
    else:
        return data
    start = sum(sizes[:part])
    return data[start : start + sizes[part]]
