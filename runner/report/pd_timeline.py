"""Both workers of a disaggregated run on one timeline, for `kvcache report`: the prefill
worker's steps above, the decode worker's below, on one wall-clock axis, each step a bar as
long as it took, coloured by what it computed. The decode lane is the picture of the stall
gone: its steps stay short while the prefill lane runs a long prompt.

The metrics file is the decode worker's (what `kvcache bench --workload pd_interference`
writes as ``*.engine-pd.metrics.json``) with the prefill worker's under ``prefill_worker``;
each has ``t0_unix_s``, the wall-clock time its steps' ``t_start_s`` count from."""

from __future__ import annotations

from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from runner.report.metrics_file import MetricsFile, StepRow

LANES = ("prefill worker", "decode worker")
KIND_COLORS = {"prefill": "#ff7f0e", "decode": "#1f77b4", "both": "#9467bd"}
KIND_LABELS = {"prefill": "prefill only", "decode": "decode only", "both": "prefill + decode"}


class Lane(NamedTuple):
    name: str
    # (start s, duration s, kind) per step, seconds from the first step of either worker
    steps: list[tuple[float, float, str]]


def is_pd_run(metrics: MetricsFile) -> bool:
    return isinstance(metrics.get("prefill_worker"), dict)


def _kind(step: StepRow) -> str | None:
    prefill, decode = step.get("num_prefill_tokens", 0), step.get("num_decode_tokens", 0)
    if prefill and decode:
        return "both"
    return "prefill" if prefill else "decode" if decode else None


def pd_lanes(metrics: MetricsFile) -> list[Lane]:
    """The two lanes, prefill worker first. Raises ValueError naming what a worker's metrics
    lack (its t0_unix_s, a step's times)."""
    workers = (metrics.get("prefill_worker"), metrics)
    t0s = []
    for name, worker in zip(LANES, workers, strict=True):
        if not isinstance(worker, dict) or not isinstance(worker.get("t0_unix_s"), int | float):
            raise ValueError(f"{name}: no t0_unix_s (the wall-clock time its steps count from)")
        t0s.append(float(worker["t0_unix_s"]))
    lanes = []
    for name, worker, t0 in zip(LANES, workers, t0s, strict=True):
        assert isinstance(worker, dict)
        steps = []
        for i, step in enumerate(worker.get("steps") or []):
            start, duration = step.get("t_start_s"), step.get("duration_s")
            if not isinstance(start, int | float) or not isinstance(duration, int | float):
                raise ValueError(f"{name}: step {i} has no t_start_s / duration_s")
            kind = _kind(step)
            if kind is not None:
                steps.append((t0 + float(start), float(duration), kind))
        lanes.append(Lane(name, steps))
    origin = min((s for lane in lanes for s, _, _ in lane.steps), default=0.0)
    return [Lane(ln.name, [(s - origin, d, k) for s, d, k in ln.steps]) for ln in lanes]


def pd_timeline_figure(metrics: MetricsFile) -> Figure:
    lanes = pd_lanes(metrics)
    fig = Figure(figsize=(11.0, 3.2))
    ax = fig.add_axes((1.2 / 11.0, 0.34, 1 - 1.5 / 11.0, 0.54))
    for row, lane in enumerate(lanes):
        y = len(lanes) - 1 - row  # the prefill worker on top
        for kind, color in KIND_COLORS.items():
            spans = [(s, d) for s, d, k in lane.steps if k == kind]
            if spans:
                ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=color, edgecolor="white",
                               linewidth=0.3)  # fmt: skip
    ax.set_yticks([len(lanes) - 1 - r + 0.5 for r in range(len(lanes))], [ln.name for ln in lanes])
    ax.set_ylim(0, len(lanes))
    ends = [s + d for lane in lanes for s, d, _ in lane.steps]
    ax.set_xlim(min((s for lane in lanes for s, _, _ in lane.steps), default=0.0),
                max(ends, default=1.0))  # fmt: skip
    ax.set_xlabel("seconds (wall clock, both workers)")
    ax.set_title("Both workers' steps on one timeline (each bar one engine step)")
    ax.grid(alpha=0.3, axis="x")
    handles = [Patch(facecolor=c, label=KIND_LABELS[k]) for k, c in KIND_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02),
               ncol=len(handles), frameon=False, fontsize=9)  # fmt: skip
    return fig
