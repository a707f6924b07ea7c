"""The engine's KV plumbing around the block manager: the tiers opened from its options
(tiers.py; the tiers themselves and their loader are kvcache/tiers), block transfers between
the device pool and host memory (transfer.py), the prefix-cache file (prefix_cache_file.py)
and the KV pool's size (memory.py).

May import: engine (config), kvcache and runner.kv_pool.store, kv_events.
"""
