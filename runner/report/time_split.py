"""Where the engine's time went, for `kvcache report`: its steps by kind (prefill only, decode
only, both), their wall time, and the shares of it that the model's forward, its weight
products and its attention kernels took (recorded on the CPU:
runner/engine/step/metrics.py). What the forward leaves is the host's: scheduling,
sampling, stop checks, caching blocks, metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from runner.report.metrics_file import StepRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes

KINDS = ("prefill only", "decode only", "prefill + decode")
# A step's recorded times, in PARTS' order: its forward, the weight products, the attention.
TimeKey = Literal["model_s", "product_s", "attention_s"]
TIME_KEYS: tuple[TimeKey, ...] = ("model_s", "product_s", "attention_s")


class TimeRow(NamedTuple):
    kind: str
    steps: int
    wall_s: float
    # Shares of wall_s; None where a step of this kind did not record it (a GPU run, torch's
    # operators instead of the C layers, or metrics written before it was recorded).
    model: float | None
    products: float | None
    attention: float | None


def time_breakdown(steps: Sequence[StepRow]) -> list[TimeRow]:
    """One row per kind of step that the run had, in KINDS order."""
    groups: dict[str, list[StepRow]] = {kind: [] for kind in KINDS}
    for step in steps:
        prefill, decode = step.get("num_prefill_tokens", 0), step.get("num_decode_tokens", 0)
        if prefill or decode:
            groups[KINDS[0] if not decode else KINDS[1] if not prefill else KINDS[2]].append(step)
    rows = []
    for kind, group in groups.items():
        if group:
            wall = sum(float(s.get("duration_s", 0.0)) for s in group)
            shares = (_share(group, key, wall) for key in TIME_KEYS)
            rows.append(TimeRow(kind, len(group), wall, *shares))
    return rows


def _share(group: list[StepRow], key: TimeKey, wall: float) -> float | None:
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


# What each step's wall time is split into for the picture, bottom to top, and its colour.
PARTS = (
    ("products", "#1f77b4"),
    ("attention", "#2ca02c"),
    ("rest of the model", "#9467bd"),
    ("host", "#7f7f7f"),
)


def step_parts_ms(steps: Sequence[StepRow]) -> np.ndarray | None:
    """[4, steps] milliseconds of each step in PARTS order, or None unless every step that
    computed something recorded its products and attention (a step that computed nothing is
    all host)."""
    parts = np.zeros((len(PARTS), len(steps)))
    for i, step in enumerate(steps):
        wall = float(step.get("duration_s", 0.0))
        model, products, attention = (step.get(k) for k in TIME_KEYS)
        if model is None or products is None or attention is None:
            if step.get("num_prefill_tokens", 0) or step.get("num_decode_tokens", 0):
                return None
            model = products = attention = 0.0
        rest = max(0.0, float(model) - float(products) - float(attention))
        parts[:, i] = (products, attention, rest, max(0.0, wall - float(model)))
    return parts * 1000.0


def draw_step_parts(ax: Axes, parts: np.ndarray, edges: np.ndarray) -> None:
    """Each step's split as filled stairs stacked bottom to top (one artist a part, so long
    runs draw quickly), on the engine-step axis the other pictures use."""
    base = np.zeros(parts.shape[1])
    for (label, color), values in zip(PARTS, parts, strict=True):
        ax.stairs(base + values, edges, baseline=base, fill=True, color=color, label=label)
        base = base + values
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, max(float(base.max()), 1e-3) * 1.3)  # room for the legend
    ax.set_xlabel("engine step")
    ax.set_ylabel("ms")
    ax.set_title("Where each step's time went")
    ax.legend(loc="upper right", ncol=4, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
