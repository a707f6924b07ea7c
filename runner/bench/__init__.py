"""Measurement tools: `kvcache bench` (harness.py, its peers, workloads and table), the GPU
bench and its step profile, weight-rounding quality, and the soak (soak*.py).

May import: kvcache, attention, backends, engine, model, sampling.
"""
