"""The torch path as an AttentionBackend: what a model runs when nobody chose a backend
(tests, tools), and the registry's "torch"."""

from __future__ import annotations

from runner.attention.backend import AttentionBackend, Capabilities
from runner.backends.torch.paged import torch_paged_attention

# Its decodes read a shared prefix once on the CPU (cascade.py), planned each step: no graphs.
TORCH_ATTENTION = AttentionBackend(
    "torch", torch_paged_attention, Capabilities(shared_prefix_plan=True)
)
