"""Attention backends and kernels: cpu/ (the C kernels, csrc/ with them) and triton/, and the
registry (registry.py) that builds a backend by name once, for the engine.

May import: attention (the contract each backend implements), backends.cpu, backends.triton.
"""
