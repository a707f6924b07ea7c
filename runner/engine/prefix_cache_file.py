"""Saving the prefix cache to a file and loading it into another engine: a warm start.

A saved cache is one safetensors file: every block of the radix tree and every tail (its
tokens and how many, its parent, its namespace root) and its K/V, with what the K/V depends on
in the metadata (the model's fingerprint, its weight rounding, the block size, the K/V layout
and dtype). Loading rebuilds the chains through the block manager's own calls, so its
invariants hold as for any request: each leaf's path is allocated (the part already loaded
matches and is held, the rest takes fresh blocks), the fresh blocks get their K/V, the path is
committed into the tree and the allocation freed, with its tail's tokens when the leaf is a
tail (so the free keeps it, as a finished request's). The blocks are left cached and
evictable, and the hit counters count none of it. Files of format 1 (full blocks only, no
`lengths`) still load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcache import BlockManager
from kvcache.store import KVStore

FORMAT = "kvcache-prefix-cache/2"  # 2: tails too, with their lengths
_FORMATS = ("kvcache-prefix-cache/1", FORMAT)  # what loads
_TENSORS = ("parents", "roots", "tokens", "kv")
_BLOCKS_PER_COPY = 256


def cache_identity(kv: KVStore, fingerprint: str, weights: str) -> dict[str, str]:
    """What a saved cache must share with the engine that loads it."""
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "weights": weights,
        "block_size": str(kv.block_size),
        "kv_layout": f"{kv.num_layers} layers x {kv.num_kv_heads} heads x {kv.head_dim}",
        "kv_dtype": kv.dtype_name,
    }


def save_prefix_cache(
    block_manager: BlockManager, kv: KVStore, identity: dict[str, str], path: Path
) -> int:
    """Write every block of the tree, every tail and their K/V to `path` (replaced whole,
    never half written); returns the number of blocks."""
    blocks = block_manager.cached_blocks()
    B = kv.block_size
    row = {b.block_id: i for i, b in enumerate(blocks)}
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.int64, device=kv.device)
    tensors = {
        "parents": torch.tensor(
            [-1 if b.parent is None else row[b.parent] for b in blocks], dtype=torch.int64
        ),
        # Roots are unsigned 64-bit hashes; int64 keeps their bits.
        "roots": torch.tensor([_signed(b.root) for b in blocks], dtype=torch.int64),
        # A tail's row is padded with zeros after its `lengths` tokens.
        "tokens": torch.tensor(
            [b.token_ids + [0] * (B - len(b.token_ids)) for b in blocks], dtype=torch.int64
        ).reshape(len(blocks), B),
        "lengths": torch.tensor([len(b.token_ids) for b in blocks], dtype=torch.int64),
        "kv": _gather_blocks(kv, ids),  # [L, 2, n, B, H, D], on the CPU
    }
    from safetensors.torch import save_file

    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(partial), metadata=identity)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return len(blocks)


def load_prefix_cache(
    block_manager: BlockManager,
    kv: KVStore,
    identity: dict[str, str],
    path: Path,
    request_id: int,
    vocab_size: int | None = None,
) -> int:
    """Rebuild the cache saved in `path` into `block_manager` and `kv` (`request_id`: an id no
    live request has, used while each chain is loaded). Returns the blocks loaded: fewer than
    saved when the free blocks run out (nothing cached is evicted for it), or when some were
    cached already. Raises ValueError naming
    the problem for a file that is not a saved cache or was saved for another model or
    layout; nothing is loaded then."""
    if not block_manager.enable_prefix_caching:
        raise ValueError("the prefix cache is off in this engine: nothing to load it into")
    parents, roots, tokens, lengths, saved_kv = _read(path, identity, kv)
    if vocab_size is not None:
        check_token_ids(tokens, lengths, vocab_size, path)
    B = block_manager.block_size
    has_child = set(parents.tolist())
    cached_before = block_manager.stats.blocks_cached
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        chain = _path(parents, leaf)
        full = len(chain) if int(lengths[leaf]) == B else len(chain) - 1  # blocks before a tail
        known = tokens[chain].reshape(-1).tolist()[: full * B + int(lengths[leaf])]
        probe = known + [0]  # one more token: every full block matches
        root = int(roots[chain[0]]) % 2**64
        if block_manager.blocks_needed(probe, root) > block_manager.stats.blocks_free:
            continue  # only free blocks: a chain must not evict one loaded before it
        alloc = block_manager.allocate(request_id, probe, root, count=False)
        try:  # the K/V of every fresh block of the chain (a tail's own block included)
            have = alloc.num_cached_tokens // B
            if have < len(chain):
                fresh = alloc.block_table[have : len(chain)]
                dst = torch.tensor(fresh, dtype=torch.int64, device=kv.device)
                kv.tensor.index_copy_(2, dst, saved_kv[:, :, chain[have:]].to(kv.device))
            block_manager.commit(request_id, probe, full * B)
        finally:  # with its tokens: a tail's block stays cached as a tail
            block_manager.free(request_id, known, len(known) if have < len(chain) else 0)
    return block_manager.stats.blocks_cached - cached_before


def _read(
    path: Path, identity: dict[str, str], kv: KVStore
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file's tensors (parents, roots, tokens, lengths, K/V), once its metadata and shapes
    say it fits this engine."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") not in _FORMATS:
                raise ValueError(f"{path}: not a kvcache prefix cache file")
            for key, ours in identity.items():
                if key != "format" and metadata.get(key) != ours:
                    raise ValueError(
                        f"{path}: saved for {key} {metadata.get(key)!r}, this engine has {ours!r}"
                    )
            parents, roots, tokens, saved_kv = (f.get_tensor(name) for name in _TENSORS)
            lengths = (
                f.get_tensor("lengths")
                if "lengths" in f.keys()
                else torch.full((len(parents),), kv.block_size, dtype=torch.int64)
            )
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors raises its own types for bad files
        raise ValueError(f"{path}: not a readable prefix cache file ({err})") from err
    n = len(parents)
    shape = (kv.num_layers, 2, n, kv.block_size, kv.num_kv_heads, kv.head_dim)
    tails = set((lengths < kv.block_size).nonzero()[:, 0].tolist()) if n else set()
    if (
        roots.shape != (n,)
        or lengths.shape != (n,)
        or bool(((lengths < 1) | (lengths > kv.block_size)).any())
        or bool(tails & set(parents.tolist()))  # a tail is never a parent
        or tokens.shape != (n, kv.block_size)
        or tuple(saved_kv.shape) != shape
        or saved_kv.dtype != kv.dtype
        or any(not -1 <= p < i for i, p in enumerate(parents.tolist()))
    ):
        raise ValueError(f"{path}: its tensors do not fit together (a damaged file?)")
    return parents, roots, tokens, lengths, saved_kv


def check_token_ids(
    tokens: torch.Tensor, lengths: torch.Tensor, vocab_size: int, path: Path
) -> None:
    """Raise ValueError when a saved block holds a token id outside the vocabulary: the file
    passes for this model's otherwise, and such an id, loaded, would be fed to the model as a
    speculative guess (an IndexError in the embedding) or matched as a prompt's prefix."""
    if not len(tokens):
        return
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    real = positions < lengths.unsqueeze(1)  # a tail's padding is not a token
    bad = real & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{path}: block {row} holds token id {int(tokens[row, col])}, outside the "
            f"vocabulary [0, {vocab_size}) (a damaged or crafted file)"
        )


def _path(parents: torch.Tensor, leaf: int) -> list[int]:
    """Rows from the top of the leaf's chain down to the leaf."""
    chain = [leaf]
    while (parent := int(parents[chain[-1]])) >= 0:
        chain.append(parent)
    return chain[::-1]


def _gather_blocks(kv: KVStore, ids: torch.Tensor) -> torch.Tensor:
    """The K/V of blocks `ids` copied to the CPU a slice at a time: on a GPU whose memory the
    pool fills, a copy of every cached block at once on the device might not fit."""
    slices = [
        kv.tensor.index_select(2, ids[i : i + _BLOCKS_PER_COPY]).cpu()
        for i in range(0, len(ids), _BLOCKS_PER_COPY)
    ]
    if not slices:
        return kv.tensor[:, :, :0].cpu().contiguous()
    return torch.cat(slices, dim=2)


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value
