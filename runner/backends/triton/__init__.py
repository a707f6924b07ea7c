"""The Triton kernels: paged attention (decode split along the context, then its reduce;
prefill), RMSNorm in one pass, and their ahead-of-time compile check. On a machine without a
GPU they run in Triton's interpreter (runner/__init__.py sets it).

May import: runner.kv_pool.store, attention, backends.torch (the shared-prefix grouping).
"""
