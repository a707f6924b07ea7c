"""A prompt's blocks as block values (kvcache/tiers/block_value.py), both ways: the prefill
worker hands over the values the engine encodes off its pool (`cached_block_values`,
`block_values`: header with tokens, parent hash, xxh3 checksum, the MAC when a cache key is
set); the decode worker checks each value that arrives against the chain it computes itself
from the prompt's tokens (its own namespace root, so another model's or another salt's blocks
never pass) and keeps the run of values that pass, up to the first one missing or bad: the
rest is recomputed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvcache import block_hashes, namespace_root
from kvcache.hashing import TOKEN_BYTES, pack_tokens
from kvcache.tiers import Miss, decode
from runner.engine.api.interface import ServingEngine


class PromptChain(NamedTuple):
    """The chained hashes and packed tokens of the blocks a prompt can take from a cache: its
    full blocks but the one holding its last token (that token is always computed)."""

    root: int
    hashes: list[int]
    tokens: list[bytes]


def prompt_chain(
    llm: ServingEngine, token_ids: Sequence[int], cache_salt: str | None
) -> PromptChain:
    """The chain of ``token_ids`` as ``llm`` names its blocks. Pure."""
    block_size = llm.config.block_size
    count = max(0, (len(token_ids) - 1) // block_size)
    root = namespace_root(llm.fingerprint, cache_salt)
    hashes = block_hashes(list(token_ids[: count * block_size]), block_size, root)
    packed = pack_tokens(list(token_ids[: count * block_size]))
    width = block_size * TOKEN_BYTES
    return PromptChain(root, hashes, [packed[i * width : (i + 1) * width] for i in range(count)])


class Checked(NamedTuple):
    """How many values (from the first one checked) passed, and why the next did not."""

    passed: int
    reason: str | None  # None: every value passed
    kvs: list[memoryview]  # the K/V bytes of each value that passed (views into it)


def check_values(
    llm: ServingEngine,
    chain: PromptChain,
    start: int,
    values: Sequence[bytes | memoryview | None],
) -> Checked:
    """Check ``values`` as blocks ``start``, ``start + 1``, ... of ``chain``: each must decode
    (format, model identity, dtype, shape, checksum, MAC) and be exactly that block (its hash,
    its parent, its tokens). Stops at the first that is missing or fails. Pure."""
    kvs: list[memoryview] = []
    for i, data in enumerate(values):
        at = start + i
        if data is None:
            return Checked(i, f"block {at} missing", kvs)
        parent = chain.hashes[at - 1] if at else chain.root
        result = decode(
            data, llm.block_spec, mac_key=llm.cache_mac_key, key=chain.hashes[at], parent=parent,
            tokens=chain.tokens[at],
        )  # fmt: skip
        if isinstance(result, Miss):
            return Checked(i, f"block {at}: {result.reason}", kvs)
        kvs.append(result.kv)
    return Checked(len(values), None, kvs)
