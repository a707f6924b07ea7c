"""The engine interface's calls that are no batch call (runner/engine/api/interface.py): checks
before a request is queued, reports, the cache's blocks (the cached prefix of a prompt, its
block values, handed-over blocks installed, block listeners), and what the measuring code reads
(recorded steps, schedules, the forward's parts). Each delegates to one of the engine's parts,
so that no other package needs to know them. `LLM` (llm.py) adds the batch calls on top."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvcache.block_cache import BlockListener
from kvcache.radix_tree import Node
from kvcache.stats import CacheStats
from kvcache.tiers import HostTier, Link, encode_chunk
from runner.engine.api.engine import Engine
from runner.engine.api.interface import (
    CachedPrefix,
    ForwardParts,
    InstalledBlocks,
    KVPool,
    QueueDepth,
    StepRecord,
)
from runner.engine.api.streaming import TextStream
from runner.engine.sequence import Sequence
from runner.engine.step.guards import locked
from runner.engine.step.scheduler import SchedulerOutput
from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from runner.attention.backend import AttentionBackend


class EngineCalls(Engine):
    """The engine loop with the interface's reports and block calls (see the module)."""

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        self.validator.check(token_ids, params)

    def room_for(self, token_ids: list[int], max_tokens: int | None) -> int:
        return self.validator.room(token_ids, max_tokens)

    def check_structured_outputs(self, spec: StructuredOutputsParams | None) -> None:
        self.grammars.check(spec)

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self.stopper, skip_special_tokens)

    def output_text(self, seq: Sequence) -> str:
        return self.stopper.output_text(seq)

    @property
    def metrics_t0(self) -> float:
        return self.recorder.t0

    @locked
    def queue_depth(self) -> QueueDepth:
        s = self.scheduler
        return QueueDepth(len(s.running), len(s.waiting), s.num_preemptions, s.last_step_tokens)

    @locked
    def has_live_requests(self) -> bool:
        return not self._requests.is_empty()

    @locked
    def recorded_steps(self, first: int = 0) -> list[StepRecord]:
        return [
            StepRecord(
                row["t_start_s"],
                row["duration_s"],
                row["num_prefill_tokens"],
                row["num_decode_tokens"],
            )
            for row in self.recorder.steps[first:]
        ]

    @locked
    def cache_stats(self) -> CacheStats:
        return self.block_manager.stats

    def kv_pool(self) -> KVPool:
        return KVPool(self.kv.num_blocks, self.kv.block_size, self.kv.dtype_name, self.kv.nbytes)

    def rank_weight_bytes(self) -> list[int]:
        return self.executor.rank_weight_bytes()

    def kv_event_endpoints(self) -> dict[str, str | bool | None] | None:
        return self.kv_events.endpoints() if self.kv_events is not None else None

    @locked
    def check_integrity(self) -> None:
        self.block_manager.check_integrity()

    @locked
    def cached_prefix(self, token_ids: Seq[int], cache_salt: str | None) -> CachedPrefix:
        return CachedPrefix(len(self._cached_nodes(token_ids, cache_salt)), self.config.block_size)

    def cached_block_values(self, token_ids: Seq[int], cache_salt: str | None) -> list[bytes]:
        with self.lock:  # found and copied while no step can evict them; encoded after
            links, payloads = self._read_nodes(self._cached_nodes(token_ids, cache_salt))
        return self._encode(links, payloads)

    def block_values(self, nodes: Seq[Node]) -> list[bytes]:
        with self.lock:
            links, payloads = self._read_nodes(nodes)
        return self._encode(links, payloads)

    def add_block_listener(self, listener: BlockListener) -> None:
        with self.lock:
            self.block_manager.add_listener(listener)

    def remove_block_listener(self, listener: BlockListener) -> None:
        with self.lock:
            self.block_manager.remove_listener(listener)

    def add_schedule_listener(self, listener: Callable[[SchedulerOutput], None]) -> None:
        with self.lock:
            self.scheduler.listeners.append(listener)

    def forward_parts(self) -> ForwardParts:
        graphs = self.runner.graphs
        return ForwardParts(self.model, self.cpu_layers, graphs, self.runner.attention)

    def attend_through(self, backend: AttentionBackend) -> None:
        with self.lock:  # never between two layers of one forward
            self.runner.attention = backend

    def host_tier(self) -> HostTier | None:
        return self.tiers.host if self.tiers is not None else None

    @locked
    def install_blocks(
        self,
        token_ids: Seq[int],
        cache_salt: str | None,
        first: int,
        kvs: Seq[bytes | memoryview],
    ) -> InstalledBlocks:
        if self.tiers is None:
            raise ValueError("this engine has no tiers: it takes no handed-over blocks")
        before = self.tiers.loaded_blocks
        held = self.tiers.install(token_ids, self._root(cache_salt), first, kvs)
        return InstalledBlocks(held, self.tiers.loaded_blocks - before)

    def _read_nodes(self, nodes: Seq[Node]) -> tuple[list[tuple[Link, bool]], list[bytes]]:
        """Each node's place in its chain and its K/V copied off the pool (under the lock)."""
        return [_link_of(n) for n in nodes], self.executor.read_blocks([n.block_id for n in nodes])

    def _encode(self, links: list[tuple[Link, bool]], payloads: list[bytes]) -> list[bytes]:
        spec, key = self.block_spec, self.cache_mac_key
        return [
            encode_chunk(spec, [link], kv, top=top, mac_key=key)
            for (link, top), kv in zip(links, payloads, strict=True)
        ]

    def _cached_nodes(self, token_ids: Seq[int], cache_salt: str | None) -> list[Node]:
        """The prompt's cached full blocks, capped as admission caps them: never the block of
        its last token."""
        usable = max(0, (len(token_ids) - 1) // self.config.block_size)
        return self.block_manager.cached_path(list(token_ids), self._root(cache_salt))[:usable]


def _link_of(node: Node) -> tuple[Link, bool]:
    """A cached block's place in its chain for its block value, and whether it is the top."""
    top = node.parent is None
    parent = node.namespace if node.parent is None else node.parent.key
    return Link(node.key, parent, node.tokens), top
