"""The KV pool's tensors (store.py): one allocation holding every layer's keys and values, where
the block manager's plain block ids point. The only torch code the KV cache needs; the block
manager itself (kvcache/) stays pure Python.

May import: nothing else of the project.
"""
