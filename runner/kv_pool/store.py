"""The paged KV tensors: one allocation for every layer's keys and values.

This is the only torch module in ``kvcache/``; the block manager hands out plain
block ids and this store is where those ids point. Layout:
``[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]`` so that
``layer(i)`` returns two contiguous views and a flat slot id
(``block * block_size + offset``) indexes ``k_cache.view(-1, kv_heads, head_dim)``.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch


class KVStore:
    """Allocates the KV cache once; never grows, never frees (the pool recycles ids)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefault: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if int(value) <= 0:
                raise ValueError(f"KVStore: {name} must be positive, got {value}")
        self.num_layers = int(num_layers)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads)
        # [layers, 2, blocks, block_size, kv_heads, head_dim]. Zeros, not empty: attention
        # reads whole blocks (padding slots and block 0 of padded tables) and masks them; NaN
        # garbage would survive a mask (0 * NaN = NaN).
        self.tensor = _zeros(shape + (self.head_dim,), dtype, self.device, prefault)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [blocks, block_size, kv_heads, head_dim] (views)."""
        return self.tensor[i, 0], self.tensor[i, 1]

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots' keys and values of every layer from one block
        to another (a prefix served from a cached block that the request will write past)."""
        # [layers, 2, num_tokens, kv_heads, head_dim] in one strided copy
        self.tensor[:, :, dst_block, :num_tokens] = self.tensor[:, :, src_block, :num_tokens]

    @property
    def dtype_name(self) -> str:
        """The elements' dtype as torch names it, without "torch." ("float16")."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def __repr__(self) -> str:
        return (
            f"KVStore(layers={self.num_layers}, blocks={self.num_blocks}, "
            f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool
) -> torch.Tensor:
    """A zero tensor. On the CPU it lives in an anonymous mapping, which the kernel zeroes
    page by page on first touch: start-up does not write the whole pool (a second for a few
    GiB), and only the blocks ever used take memory. With ``prefault`` every page is written
    now instead (a server's choice: a fault inside a step or a pull's copy costs 13x the copy
    itself, 0.52 ms against 0.04 ms a block of the default model, on the running decodes'
    core; 0.45 s a GiB at start-up, one sequential write being the fastest way in)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private: mmap's default, MAP_SHARED, would share the pool with a forked child (each
    # would write the other's KV) and put it in shmem, which faults in slower. The tensor
    # keeps the mapping alive.
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if prefault:
        np.frombuffer(buffer, dtype=np.uint8)[:] = 0
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
