"""The tiers below the device pool in `kvcache report`: one row per tier (hit tokens, blocks
and bytes read and written, rejected values, errors), with the dropped writes and the time a
loaded block took. Reads the metrics' ``cache_tiers`` (LLM.stats()'s), absent without tiers."""

from __future__ import annotations

from runner.report.metrics_file import MetricsFile, TierCounters

HEADER = ("tier", "hit tok", "read blk", "read MiB", "written blk", "written MiB", "rejected",
          "errors")  # fmt: skip


def tier_rows(metrics: MetricsFile) -> list[tuple[str, ...]]:
    """One row per tier, the device pool first (its hits: those no tier served). Pure."""
    tiers = metrics.get("cache_tiers")
    if not isinstance(tiers, dict):
        return []
    cache = metrics.get("cache", {})
    per_tier: dict[str, TierCounters] = tiers.get("tiers", {})
    total = int(cache.get("hit_tokens", 0)) + int(cache.get("readmit_hit_tokens", 0))
    below = sum(int(t.get("hit_tokens", 0)) for t in per_tier.values())
    rows: list[tuple[str, ...]] = [("device", f"{max(0, total - below):,}", *[""] * 6)]
    for name, t in per_tier.items():
        rows.append(
            (
                name,
                f"{t.get('hit_tokens', 0):,}",
                f"{t.get('hit_blocks', 0):,}",
                f"{t.get('read_bytes', 0) / 2**20:.1f}",
                f"{t.get('written_blocks', 0):,}",
                f"{t.get('written_bytes', 0) / 2**20:.1f}",
                f"{t.get('rejected_blocks', 0):,}",
                f"{t.get('errors', 0):,}",
            )
        )
    return rows


def tier_footer(metrics: MetricsFile) -> str:
    tiers = metrics.get("cache_tiers") or {}
    return (
        f"dropped writes {tiers.get('dropped_writes', 0):,}, "
        f"{tiers.get('loaded_blocks', 0):,} blocks loaded at "
        f"{tiers.get('load_ms_per_block', 0.0):.2f} ms each"
    )
