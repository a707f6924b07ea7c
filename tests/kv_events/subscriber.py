"""A KV-event subscriber written from vLLM's published schema alone (its example subscriber's
types: array-like msgpack structs, tagged events), as llm-d or Dynamo would decode us. It keeps
what each block hash stands for and follows the sequence numbers, replaying any gap."""

from __future__ import annotations

import time

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class Subscriber:
    """Follows one publisher: block hash -> (parent hash, the block's tokens)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str = "", bind: bool = False
    ) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        if bind:  # llm-d's way: one subscriber bound, every engine connecting to it
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.topics: set[bytes] = set()
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay_endpoint
        # medium -> block hash -> (parent hash, the block's tokens)
        self.views: dict[str | None, dict[int, tuple[int | None, tuple[int, ...]]]] = {}
        self.last_seq = -1
        self.replays = 0
        self.media: set[str | None] = set()
        self.removed: dict[str | None, int] = {}  # blocks removed, by medium

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.media.add(event.medium)
                view = self.views.setdefault(event.medium, {})
                parent = event.parent_block_hash
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                    view[block_hash] = (parent, tokens)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                view = self.views.setdefault(event.medium, {})
                self.removed[event.medium] = self.removed.get(event.medium, 0) + 1
                for block_hash in event.block_hashes:
                    view.pop(block_hash, None)
            else:
                self.views.clear()

    @property
    def blocks(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """The device pool's blocks (medium GPU)."""
        return self.views.get("GPU", {})

    def replay_from(self, start: int) -> None:
        """Ask the replay socket for every batch from ``start`` on (vLLM's protocol)."""
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self.replays += 1
        try:
            while dealer.poll(5000):
                _, seq_bytes, payload = dealer.recv_multipart()
                if not payload:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq:
                    self.apply(self.decoder.decode(payload))
                    self.last_seq = seq
            raise AssertionError("the replay did not end")
        finally:
            dealer.close()

    def drain(self, quiet_s: float = 0.3, limit_s: float = 20.0) -> None:
        """Apply messages until none has come for ``quiet_s``; a gap is replayed first."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                self.replay_from(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
            self.apply(self.decoder.decode(payload))
            self.last_seq = seq

    def prefixes(self, medium: str = "GPU") -> set[tuple[int, ...]]:
        """Each cached block's whole token prefix (its chain's tokens up to its end)."""
        out: set[tuple[int, ...]] = set()
        blocks = self.views.get(medium, {})
        for block_hash in blocks:
            tokens: tuple[int, ...] = ()
            walk: int | None = block_hash
            while walk is not None:
                parent, own = blocks[walk]
                tokens = own + tokens
                walk = parent
            out.add(tokens)
        return out

    def close(self) -> None:
        self.sub.close()
        self.context.term()
