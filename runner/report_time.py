"""Where the engine's time went, for `kvcache report`: its steps by kind (prefill only, decode
only, both), their wall time, and the shares of it that the model's forward, its weight
products and its attention kernels took (recorded on the CPU: runner/step_clock.py). What the
forward leaves is the host's: scheduling, sampling, stop checks, caching blocks, metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

KINDS = ("prefill only", "decode only", "prefill + decode")


class TimeRow(NamedTuple):
    kind: str
    steps: int
    wall_s: float
    # Shares of wall_s; None where a step of this kind did not record it (a GPU run, torch's
    # operators instead of the C layers, or metrics written before it was recorded).
    model: float | None
    products: float | None
    attention: float | None


def time_breakdown(steps: Sequence[dict[str, Any]]) -> list[TimeRow]:
    """One row per kind of step that the run had, in KINDS order."""
    groups: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for step in steps:
        prefill, decode = step.get("num_prefill_tokens", 0), step.get("num_decode_tokens", 0)
        if prefill or decode:
            groups[KINDS[0] if not decode else KINDS[1] if not prefill else KINDS[2]].append(step)
    rows = []
    for kind, group in groups.items():
        if group:
            wall = sum(float(s.get("duration_s", 0.0)) for s in group)
            shares = (_share(group, key, wall) for key in ("model_s", "product_s", "attention_s"))
            rows.append(TimeRow(kind, len(group), wall, *shares))
    return rows


def _share(group: list[dict[str, Any]], key: str, wall: float) -> float | None:
    """The share of `wall` that `key` took, when every step of the group recorded it."""
    values = [s.get(key) for s in group]
    if wall <= 0 or any(v is None for v in values):
        return None
    return sum(float(v) for v in values if v is not None) / wall


def time_cells(row: TimeRow) -> tuple[str, ...]:
    """The row as `kvcache report` prints it."""

    def pct(share: float | None) -> str:
        return "-" if share is None else f"{share:.0%}"

    host = None if row.model is None else max(0.0, 1.0 - row.model)
    return (
        row.kind,
        f"{row.steps:,}",
        f"{row.wall_s:.2f}",
        f"{1000 * row.wall_s / row.steps:.1f}",
        pct(row.model),
        pct(row.products),
        pct(row.attention),
        pct(host),
    )


TIME_HEADER = ("steps", "count", "wall s", "ms/step", "model", "products", "attention", "host")
