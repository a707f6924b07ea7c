"""The metrics file's shapes, as types: what `LLM.metrics()` writes (schema version 1: a header
of the run's settings, the cache's counters, one row per request and one per step;
runner/engine/step/metrics.py) and what `kvcache report` reads once `load_metrics` has checked
it (fields.py names the fields it checks).

The report imports nothing else of the project, so these types are declared here, from the
file's side: a file written by an older engine or another tool may lack any optional field.
"""

from __future__ import annotations

from typing import NotRequired, TypeAlias, TypedDict

# A value parsed from JSON, before its field is checked.
JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"


class CacheCounters(TypedDict, total=False):
    """``cache``: the block manager's counters at the end of the run (kvcache/stats.py)."""

    query_tokens: int
    hit_tokens: int
    copied_tokens: int
    readmit_query_tokens: int
    readmit_hit_tokens: int
    evicted_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_tails: int
    blocks_free: int
    hit_rate: float


class TierCounters(TypedDict, total=False):
    """One tier below the device pool (kvcache/tiers/tiered.py's TierCounters)."""

    hit_tokens: int
    hit_blocks: int
    read_bytes: int
    fetched_values: int
    fetched_bytes: int
    written_blocks: int
    written_values: int
    written_bytes: int
    rejected_blocks: int
    errors: int
    skipped: int


class CacheTiers(TypedDict, total=False):
    """``cache_tiers``: present only for an engine with tiers."""

    tiers: dict[str, TierCounters]
    dropped_writes: int
    failed_writes: int
    loaded_blocks: int
    load_ms_per_block: float


class SegmentCounters(TypedDict, total=False):
    """``segments``: reuse of prompts' later segments (docs/SEGMENTS.md)."""

    segment_query_tokens: int
    segment_hit_tokens: int
    segment_hit_rate: float
    segment_recomputed_tokens: int
    segment_recompute_fraction: float
    segments_filled: int
    segment_filled_tokens: int


class RequestRow(TypedDict):
    """One sequence of the run (a request of n samples has n rows, "<id>#<j>")."""

    id: JSONValue  # any value: shown as text
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reused_segment_tokens: NotRequired[int]
    arrival_time_s: NotRequired[float]
    first_token_time_s: NotRequired[float | None]
    finish_time_s: NotRequired[float | None]
    ttft_s: NotRequired[float | None]
    itl_s: NotRequired[list[float] | None]
    num_preemptions: NotRequired[int]
    arrival_step: NotRequired[int | None]
    finish_reason: NotRequired[str | None]
    prefix_key: NotRequired[str | None]
    prefix_preview: NotRequired[str | None]


class StepRow(TypedDict):
    """One engine step. ``states`` maps a request's row (as a decimal string) to what the step
    did with it; the ``*_s`` shares are None where the step did not record them."""

    hit_tokens_cum: int
    query_tokens_cum: int
    step: NotRequired[int]
    t_start_s: NotRequired[float]
    duration_s: NotRequired[float]
    num_prefill_tokens: NotRequired[int]
    num_decode_tokens: NotRequired[int]
    num_cached_tokens: NotRequired[int]
    states: NotRequired[dict[str, str] | None]
    model_s: NotRequired[float | None]
    product_s: NotRequired[float | None]
    attention_s: NotRequired[float | None]


class MetricsFile(TypedDict):
    """The whole file. A disaggregated run's (the decode worker's) holds the prefill worker's
    under ``prefill_worker``, each with ``t0_unix_s``: the wall-clock time its steps'
    ``t_start_s`` count from."""

    version: int
    cache: CacheCounters
    requests: list[RequestRow]
    steps: list[StepRow]
    wall_time_s: float
    model: NotRequired[str]
    batching: NotRequired[str]
    enable_prefix_caching: NotRequired[bool]
    block_size: NotRequired[int]
    num_kv_blocks: NotRequired[int]
    max_num_batched_tokens: NotRequired[int | None]
    cpu_weight_dtype: NotRequired[str]
    kv_cache_dtype: NotRequired[str]
    speculative_tokens: NotRequired[int]
    num_draft_tokens: NotRequired[int | None]
    num_accepted_tokens: NotRequired[int | None]
    num_preemptions: NotRequired[int | None]
    cache_tiers: NotRequired[CacheTiers]
    segments: NotRequired[SegmentCounters]
    t0_unix_s: NotRequired[float]
    prefill_worker: NotRequired[MetricsFile]
