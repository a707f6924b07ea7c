"""When the Triton decode reads a shared prefix once for its group: the cost model.

Shared-prefix (cascade) attention saves the bytes of reading a group's prefix once per member,
and costs a kernel of its own per layer, a reduce over more partitions, and (in a small group)
programs that have too few query rows to fill the GPU. A decode step is bound by memory, so
the model compares the bytes the prefix pass saves with a fixed overhead expressed in bytes:
the launches and the extra partitions' reduce, which cost the same whatever the prefix. A group
is read once only where the saved bytes exceed that overhead by a wide margin.

The thresholds are the only numbers and they live here, in CascadeThresholds. Their defaults are
conservative guesses until bench/gpu/cascade.py has measured the kernel on a GPU (it
times the plain and the shared-prefix decode over prefix lengths 16..4,096 and group sizes
2..256 and reports where the model chooses wrong); the rule they must keep is that the choice
is never slower than the plain kernel by more than noise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CascadeThresholds:
    """A group reads its prefix once when all of these hold (per layer, per KV head summed)."""

    # A prefix shorter than this is a partition or two of the plain kernel: nothing to win.
    min_prefix_tokens: int = 256
    # Fewer members share too little: the prefix pass's programs have a few query rows each.
    min_group_size: int = 4
    # Bytes of K/V the group must save in one layer, against the fixed cost of a launch and a
    # reduce over more partitions (a few microseconds: ~10-20 MB at an H200's 4.8 TB/s).
    min_saved_bytes: int = 32 << 20


# The default (conservative) model; NEVER turns the shared-prefix path off (a benchmark's
# baseline), ALWAYS turns it on for every group found (tests of the kernel).
DEFAULT_THRESHOLDS = CascadeThresholds()
NEVER = CascadeThresholds(min_prefix_tokens=1 << 62)
ALWAYS = CascadeThresholds(min_prefix_tokens=0, min_group_size=2, min_saved_bytes=0)


def saved_bytes(
    prefix_tokens: int, group_size: int, prefix_reads: int, kv_bytes_per_token: int
) -> int:
    """K/V bytes one layer no longer reads when a group of `group_size` reads its prefix
    `prefix_reads` times (once per chunk of members) instead of once per member;
    `kv_bytes_per_token` is K and V of every KV head of one token in one layer."""
    return (group_size - prefix_reads) * prefix_tokens * kv_bytes_per_token


def use_shared_prefix(
    prefix_tokens: int,
    group_size: int,
    prefix_reads: int,
    kv_bytes_per_token: int,
    thresholds: CascadeThresholds = DEFAULT_THRESHOLDS,
) -> bool:
    """Whether a group of `group_size` decodes sharing `prefix_tokens` tokens reads them once
    (per chunk: `prefix_reads` times) in this step."""
    t = thresholds
    return (
        prefix_tokens >= t.min_prefix_tokens
        and group_size >= t.min_group_size
        and group_size > prefix_reads
        and saved_bytes(prefix_tokens, group_size, prefix_reads, kv_bytes_per_token)
        >= t.min_saved_bytes
    )
