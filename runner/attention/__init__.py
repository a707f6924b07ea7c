"""Attention's contract: the step's metadata (metadata.py), the backend a model is given
(backend.py), and the torch reference path with its per-step plan, shared-prefix (cascade)
and soft-capped variants.

May import: kvcache.store.
"""
