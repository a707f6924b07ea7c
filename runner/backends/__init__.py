"""Attention backends and kernels: torch/ (the reference path), cpu/ (the C kernels, csrc/
with them) and triton/, and the registry (registry.py), the one place that knows their names,
which builds a backend by name once, for the engine.

May import: attention (the contract each backend implements), backends.torch, backends.cpu,
backends.triton.
"""
