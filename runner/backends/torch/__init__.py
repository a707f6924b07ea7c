"""The torch attention backend ("torch"), the reference path every other backend is checked
against: paged attention in torch's SDPA (paged.py) over a per-step plan (plan.py), a prefix
shared by a step's sequences read once (cascade.py, whose grouping the other backends plan
from too), long cached contexts read in place (context_parts.py), soft-capped scores
(capped.py); the backend itself in backend.py.

May import: runner.kv_pool.store, attention.
"""
