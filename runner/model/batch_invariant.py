"""Deterministic mode on CUDA: every matrix product of the model through the batch-invariant
Triton kernel (runner/backends/triton/batch_invariant.py) instead of cuBLAS, whose kernels
and split of K follow the number of rows (docs/DETERMINISM.md)."""

from __future__ import annotations

import torch
from torch import nn

from runner.backends.triton.batch_invariant import rows_matmul


class RowsLinear(nn.Linear):
    """nn.Linear whose product is `rows_matmul`: a row's result the same bits in any batch.
    It takes over an existing layer's parameters (no copy), so loading and counting see a
    Linear as before."""

    @classmethod
    def taking_over(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> RowsLinear:
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = weight  # type: ignore[assignment]  # the layer's Parameter itself
        layer.bias = bias  # type: ignore[assignment]  # nn.Linear keeps None for no bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_matmul(x, self.weight, self.bias)


def route_linears(model: nn.Module, tied_head: torch.Tensor | None = None) -> int:
    """Replace each nn.Linear of `model` by a RowsLinear on the same parameters; with
    `tied_head` (the embedding of a model whose LM head is tied to it) also give the model an
    `lm_head` on it, so its logits go through the kernel too. The number of layers replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, RowsLinear.taking_over(child.weight, child.bias))
                replaced += 1
    if tied_head is not None:
        model.lm_head = RowsLinear.taking_over(tied_head, None)
        replaced += 1
    return replaced
