"""The bench's table: one row per system, a column per figure (bench/harness.py fills
them)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class EngineFigures(TypedDict, total=False):
    """The figures only some systems have: the engine's own (hit rate, its prefill-only steps,
    ITL, MFU), an outside peer's tokens equal to the reference's."""

    hit_rate: float
    prefill_only_tokens: int
    prefill_only_s: float
    preemptions: int
    kv_pool_mib: float
    decode_outside_matmul: float
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    prefill_mfu: float
    matching_tokens: int
    reference_tokens: int


class BenchRow(EngineFigures):
    """One system's row of the table (and of --json)."""

    system: str
    workload: str
    requests: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    prefill_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    matches_reference: bool | None
    vs_hf_static: NotRequired[float | None]


def format_table(rows: list[BenchRow], peak: float, rss_mib: float) -> str:
    head = [
        "system",
        "wall s",
        "out tok/s",
        "x hf-static",
        "prefill tok",
        "hit rate",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "prefill MFU",
        "decode outside matmul",
        "match",
    ]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [
            r["system"],
            f"{r['wall_s']:.2f}",
            f"{r['output_tok_s']:.1f}",
            _fmt(r.get("vs_hf_static"), "{:.2f}x"),
            str(r["prefill_tokens"]),
            _fmt(r.get("hit_rate"), "{:.1%}"),
            _fmt(r["ttft_p50_ms"], "{:.0f}"),
            _fmt(r["ttft_p99_ms"], "{:.0f}"),
            _fmt(r.get("itl_p50_ms"), "{:.0f}"),
            _fmt(r.get("itl_p99_ms"), "{:.0f}"),
            _fmt(r.get("prefill_mfu"), "{:.0%}"),
            _fmt(r.get("decode_outside_matmul"), "{:.0%}"),
            _match(r),
        ]
        lines.append(" | ".join(cells))
    lines.append(
        f"\nfloat32 matmul peak measured now: {peak:.0f} GFLOP/s; peak RSS {rss_mib:.0f} MiB"
    )
    if any("bf16dot" in r["system"] for r in rows):
        lines.append(
            "prefill MFU is against the float32 peak: bfloat16 dot products (bf16dot) do up to "
            "twice its multiply-adds, so they read above 100%"
        )
    return "\n".join(lines)


def _match(row: BenchRow) -> str:
    """True/False, or for a peer outside the process (other arithmetic, so some difference is
    expected) the tokens equal to the reference's before the first difference, of all."""
    if row["matches_reference"] is not False or "matching_tokens" not in row:
        return _fmt(row["matches_reference"], "{}")
    return f"{row['matching_tokens']}/{row['reference_tokens']} tok"


def _fmt(value: float | bool | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
