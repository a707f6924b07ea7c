"""The CPU kernels: C sources in csrc/ compiled at first use (loader.py), their ctypes
interface (abi.py) and Python calls (kernel.py), packed weights (panels.py, linear.py,
quant.py), the paged attention backend (attention.py) and the step split it shares with the C
layer stack (split.py).

May import: runner.kv_pool.store, attention, backends.torch (the fallback where the kernels cannot
run, and the shared-prefix grouping).
"""
