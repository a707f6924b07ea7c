"""The KV-event wire schema, as vLLM publishes it (msgpack through msgspec).

A published message is three ZeroMQ frames: the topic, an 8-byte big-endian sequence number,
and one ``EventBatch``. Structs are encoded as msgpack arrays (``array_like``); events carry
their class name as a leading tag, so a batch reads
``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ...], rank]``.
Field names, order and tags are the public contract subscribers decode against: change none.
"""

from __future__ import annotations

import msgspec

# The medium vLLM names its engine's own KV pool by (the device pool, even on its CPU build);
# a subscriber weighs a hit by where the block lives, so this engine's pool says the same.
MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"  # the host tier (vLLM's CPU offloading says "CPU")
MEDIUM_DISK = "DISK"  # the disk tier
MEDIA = (MEDIUM_POOL, MEDIUM_HOST, MEDIUM_DISK)  # what this engine publishes; a subscriber
# that keeps a view per medium keeps these alone (a medium name is the publisher's to invent)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what a KV cache holds."""


class BlockStored(KVCacheEvent):
    """Blocks that entered the cache, in chain order: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (None at the top of a chain), each next block's parent is the one
    before it. ``token_ids`` are all the blocks' tokens, ``block_size`` of them a block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that left the cache (a child is removed before its parent)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Everything the cache held is gone (a reset, or a start with an empty cache)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one step (or of one flush of the publisher's queue), oldest first."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# Any one event, as a batch lists them.
Event = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(batch: EventBatch) -> bytes:
    """The batch's msgpack bytes. Pure."""
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its bytes; msgspec.ValidationError or DecodeError if they do not fit the
    schema. Pure."""
    return msgspec.msgpack.decode(payload, type=EventBatch)
