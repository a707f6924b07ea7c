"""Cache numbers the reports print.

Token counters only grow. A prompt is counted once, when first admitted; a preempted request
that is admitted again counts into the ``readmit_*`` pair instead, so recomputation after
preemption never inflates (or deflates) the hit rate. ``hit_tokens`` are tokens actually served
from the cache (capped so one prompt token is always computed), never tokens recomputed.
The ``blocks_*`` fields are a snapshot of the pool when the stats were read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens of first admissions
    hit_tokens: int = 0  # of those, tokens served from the cache
    copied_tokens: int = 0  # of those, served by copying a partial block's slots
    readmit_query_tokens: int = 0  # tokens of re-admissions after preemption
    readmit_hit_tokens: int = 0  # of those, tokens served from the cache
    evicted_blocks: int = 0  # cached blocks reclaimed by eviction
    blocks_in_use: int = 0  # ref > 0 now
    blocks_cached: int = 0  # ref 0, holding a tree node's or a tail's KV now (reclaimable)
    blocks_tails: int = 0  # of those, tails: partial last blocks kept to copy from
    blocks_free: int = 0  # ref 0, holding nothing now

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens; 0.0 before any query."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field plus ``hit_rate``, as plain numbers. Pure."""
        out: dict[str, Any] = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out
