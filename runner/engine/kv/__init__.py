"""The engine's KV plumbing around the block manager: the host and disk tiers (kv_tiers.py),
block transfers between the device pool and host memory (kv_transfer.py), the prefix-cache
file (prefix_cache_file.py) and the KV pool's size (memory.py).

May import: engine (config), kvcache and runner.kv_pool.store, kv_events.
"""
