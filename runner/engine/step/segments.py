"""Reuse beyond the prefix: a prompt's later segments served from their own cached K/V.

A prompt given as segments (documents, retrieved chunks, tool outputs) is one token list with
the segments' boundaries on its Sequence. Its first segment is an ordinary prefix. Each later
segment is cached on its own, as the prompt its tokens alone make (positions 0 .. n - 1, under
the request's namespace root): the same blocks, tree, tiers and eviction as every prefix, keyed
by its own tokens, so it hits wherever it appears. A request's life with segments:

1. `reserve` (at admission, before the request's blocks are taken): the tiers are asked for
   each later segment, then its cached full blocks are held for the request (a *reader*, a
   request id of the block manager's that never publishes). A segment missing from the cache
   is computed alone and cached now if it has been seen before (`Doorkeeper`): a document
   seen once is computed in its prompt and costs the cache nothing, so a stream of novel
   documents cannot flush the documents that keep coming back. The region to blend runs from
   the first reused segment to the end of the last one (the prompt's last token excepted).
2. The scheduler computes the prompt up to the region as usual (exact prefix K/V).
3. `run` (when the prompt is computed up to the region): the cached K/V are placed into the
   request's slots, keys turned to their new positions, then blended (runner/model/blend.py):
   `blend_ratio` of the reused tokens, those whose values moved most, are recomputed
   with the full context in every later layer. The readers are let go.
4. The scheduler computes the rest as usual. K/V past the region's start are approximate, so
   the request never publishes them (`Sequence.exact_limit`): no later prompt can be served
   them as an exact prefix.

`blend_ratio` 1 recomputes everything: the engine then runs the prompt as plain tokens and never
reaches this module, so the output is the plain engine's, bit for bit.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcache import BlockManager, Purpose, hash_block
from kvcache.tiers.loader import TierLoader
from runner.engine.sequence import BlendPlan, ReusedSegment
from runner.engine.sequence import Sequence as Seq
from runner.model.blend import BlendRegion, Cached, Placement, layout

log = logging.getLogger(__name__)

# Distinct segments the doorkeeper remembers having seen once (about 100 bytes each).
DOORKEEPER_ENTRIES = 1 << 16


@dataclass
class SegmentStats:
    """Counters of segment reuse, over first admissions (a hit rate counts each prompt once)."""

    query_tokens: int = 0  # tokens of later segments past the cached prefix, asked for
    hit_tokens: int = 0  # of them, served from segments' cached K/V
    recomputed_tokens: int = 0  # of the hit tokens, recomputed past the selection layer
    filled_segments: int = 0  # segments computed alone and cached (their second sighting)
    filled_tokens: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "segment_query_tokens": self.query_tokens,
            "segment_hit_tokens": self.hit_tokens,
            "segment_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "segment_recomputed_tokens": self.recomputed_tokens,
            "segment_recompute_fraction": (
                self.recomputed_tokens / self.hit_tokens if self.hit_tokens else 0.0
            ),
            "segments_filled": self.filled_segments,
            "segment_filled_tokens": self.filled_tokens,
        }


class KVWriter(Protocol):
    """The model runner's K/V writes that segment reuse asks for (ModelRunner has them)."""

    def compute_kv(self, token_ids: list[int], start: int, block_table: list[int]) -> None: ...

    def place_and_blend(self, placement: Placement, region: BlendRegion, ratio: float) -> int: ...


class Doorkeeper:
    """Which segments have been seen before (a bounded LRU of their hashes): a segment is
    cached alone from its second sighting on."""

    def __init__(self, capacity: int = DOORKEEPER_ENTRIES) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def seen_before(self, key: int) -> bool:
        """Whether `key` was seen before; remembers it either way. Mutates the LRU."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return False


@dataclass(eq=False)
class SegmentReuse:
    """Plans, places and blends the reused segments of the engine's requests."""

    bm: BlockManager
    runner: KVWriter
    ratio: float  # the engine's blend_ratio, for prompts without their own
    copy_slots: Callable[[int, int, int], None]
    tiers: TierLoader | None = None
    # Device work after what is queued (an overlapped step may still be writing the prompt's
    # prefix); None: at once.
    run_ordered: Callable[[Callable[[], None]], None] | None = None
    stats: SegmentStats = field(init=False, default_factory=SegmentStats)
    doorkeeper: Doorkeeper = field(init=False, default_factory=Doorkeeper)
    # Block-manager ids of readers and fills: below the tier loads' -1 (sequence ids are never
    # negative).
    ids: Iterator[int] = field(init=False, default_factory=lambda: itertools.count(-2, -1))

    @property
    def block_size(self) -> int:
        return self.bm.block_size

    # ------------------------------------------------------------------ admission
    def reserve(self, seq: Seq, counted: bool) -> None:
        """Plan the sequence's blend and hold the cached segments it reads (see the module);
        sets seq.blend, or leaves it None when no later segment is reused. `counted`: a first
        admission, whose tokens go into the stats."""
        tokens, root, bs = seq.token_ids, seq.root, self.block_size
        seq.blend, seq.exact_limit = None, None
        cached = self.bm.cached_prefix_length(tokens, root)
        last = seq.num_prompt_tokens - 1  # the prompt's last token samples: never blended
        reused: list[ReusedSegment] = []
        asked = 0
        for start, end in seq.segments:
            if start < cached:
                continue  # inside the cached prefix: a prefix hit
            asked += end - start
            end = min(end, last)
            if end - start < bs:
                continue  # not one full block of its own to reuse
            segment = tokens[start:end]
            found = self._hold(segment, root)
            if found is None and self.doorkeeper.seen_before(segment_key(segment, root)):
                if self._fill_safely(seq, segment):
                    found = self._hold(segment, root)
            if found is not None:
                reader, blocks = found
                reused.append(ReusedSegment(start, len(blocks) * bs, blocks, reader))
        hit = sum(r.num_tokens for r in reused)
        if counted:
            self.stats.query_tokens += asked
            self.stats.hit_tokens += hit
        if not reused:
            return
        seq.blend = BlendPlan(reused[0].start, reused[-1].start + reused[-1].num_tokens, reused)
        seq.exact_limit = reused[0].start
        seq.num_reused_segment_tokens = hit

    def _hold(self, segment: Sequence[int], root: int) -> tuple[int, list[int]] | None:
        """(reader id, block ids) of the segment's cached full blocks, held; None when its
        first block is not cached (the tiers asked first)."""
        if self.tiers is not None:
            self.tiers.load(list(segment) + [0], root)  # + 1: a load leaves the last token
        reader = next(self.ids)
        blocks = self.bm.borrow(reader, segment, root)
        if not blocks:
            self.bm.free(reader)
            return None
        return reader, blocks

    def _fill_safely(self, seq: Seq, segment: Sequence[int]) -> bool:
        """`_fill`, a failure of which leaves the segment to be computed in its prompt."""
        try:
            return self._fill(segment, seq.root)
        except Exception:  # noqa: BLE001 - the request goes on; the segment is not cached
            log.exception("caching a segment of request %s failed", seq.request_id)
            return False

    def _fill(self, segment: Sequence[int], root: int) -> bool:
        """Compute the segment alone and cache it (its full blocks in the tree, and the tiers'
        writes as for any commit); False when the pool cannot spare the blocks now."""
        tokens = list(segment)
        if not self.bm.can_allocate(tokens, root):
            return False
        filler = next(self.ids)
        alloc = self.bm.allocate(filler, tokens, root, Purpose.LOADING)
        computed = alloc.num_cached_tokens
        try:
            if alloc.copy is not None:
                self.copy_slots(*alloc.copy)
            start = computed
            self._on_device(
                lambda: self.runner.compute_kv(tokens[start:], start, alloc.block_table)
            )
            computed = len(tokens)
            self.bm.commit(filler, tokens, computed)
        finally:
            self.bm.free(filler, tokens, computed)
        self.stats.filled_segments += 1
        self.stats.filled_tokens += len(tokens) - start
        return True

    # ------------------------------------------------------------------ the blend
    def run(self, seq: Seq, block_table: Sequence[int]) -> None:
        """Place and blend the sequence's reused segments into its blocks; the sequence is then
        computed up to the plan's end. Lets the readers go. Mutates the sequence's progress."""
        plan = seq.blend
        assert plan is not None and seq.num_computed_tokens == plan.start
        cached = [Cached(r.start, r.num_tokens, r.blocks) for r in plan.reused]
        placement, region = layout(
            seq.token_ids, plan.start, plan.end, cached, block_table, self.block_size
        )
        ratio = self.ratio if seq.blend_ratio is None else seq.blend_ratio
        recomputed: list[int] = []
        try:
            self._on_device(
                lambda: recomputed.append(self.runner.place_and_blend(placement, region, ratio))
            )
        except Exception:  # noqa: BLE001 - the request goes on as plain tokens, exact
            log.exception("blending request %s failed: its prompt is computed", seq.request_id)
            self.release(seq)
            seq.blend, seq.exact_limit, seq.num_reused_segment_tokens = None, None, 0
            return  # the region's slots are computed over by the prefill that follows
        self.release(seq)
        if recomputed and seq.num_preemptions == 0:
            self.stats.recomputed_tokens += recomputed[0]
        seq.num_computed_tokens = plan.end
        seq.blend = None

    def release(self, seq: Seq) -> None:
        """Let go of the segments a sequence's plan holds (its blend ran, or it was preempted
        or finished first). Mutates the block manager's readers."""
        plan = seq.blend
        if plan is None:
            return
        for r in plan.reused:
            if r.reader in self.bm:
                self.bm.free(r.reader)

    def _on_device(self, work: Callable[[], None]) -> None:
        if self.run_ordered is None:
            work()
        else:
            self.run_ordered(work)


def segment_key(segment: Sequence[int], root: int) -> int:
    """A segment's identity for the doorkeeper: its tokens hashed under its namespace root."""
    return hash_block(root, segment)
