"""Attention's contract: the step's metadata (metadata.py), and the backend a model is given
(backend.py): one layer's call (AttentionCall), what a backend can do (Capabilities) and the
backend itself. The backends live in runner/backends/.

May import: runner.kv_pool.store.
"""
