"""One self-contained HTML page for a metrics file: pictures of the schedule and the cache.

Figures are drawn with matplotlib's object-oriented API (`Figure`, never pyplot), which
renders through Agg without touching global backend state, and are embedded as base64 PNGs
so the page can be mailed or attached to an issue without its images going missing.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from runner.report.metrics_file import MetricsFile
from runner.report.pd_timeline import is_pd_run, pd_timeline_figure
from runner.report.summary import NO_PREFIX, prefix_breakdown, summary_rows
from runner.report.time_split import (
    TIME_HEADER,
    draw_step_parts,
    step_parts_ms,
    time_breakdown,
    time_cells,
)

# Index in this list = the code stored in the timeline matrix; 0 is "not in the engine".
STATES = ["absent", "waiting", "cached", "prefill", "decode", "preempted", "held"]
COLORS = ["#ffffff", "#d9d9d9", "#2ca02c", "#ff7f0e", "#1f77b4", "#d62728", "#9467bd"]
LABELS = {
    "waiting": "waiting",
    "cached": "cached prefix",
    "prefill": "computed prefill",
    "decode": "decode",
    "preempted": "preempted",
    "held": "held (finished, slot kept)",
}
MAX_TIMELINE_ROWS = 200  # beyond this the rows are thinner than a pixel; show the first ones
MAX_REQUEST_ROWS = 200


FIG_WIDTH, LEFT_IN, RIGHT_IN = 11.0, 1.2, 0.3


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    # No bbox_inches="tight": cropping would shift each plot differently, and the three
    # pictures are meant to line up step for step down the page.
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(height: float, bottom_in: float = 0.6, top_in: float = 0.4) -> tuple[Figure, Axes]:
    """A figure whose axes sit at the same inches from the left and right as every other."""
    fig = Figure(figsize=(FIG_WIDTH, height))
    ax = fig.add_axes(
        (
            LEFT_IN / FIG_WIDTH,
            bottom_in / height,
            (FIG_WIDTH - LEFT_IN - RIGHT_IN) / FIG_WIDTH,
            (height - bottom_in - top_in) / height,
        )
    )
    return fig, ax


def _step_edges(metrics: MetricsFile) -> np.ndarray:
    """Step k is drawn over [k, k+1) in every figure, so the columns align."""
    steps = metrics["steps"]
    first = steps[0]["step"] if steps else 0
    return np.arange(first, first + len(steps) + 1)


def state_matrix(metrics: MetricsFile, max_rows: int = MAX_TIMELINE_ROWS) -> np.ndarray:
    """[requests, steps] uint8 codes into STATES; unknown state names count as absent."""
    n_req = min(len(metrics["requests"]), max_rows)
    steps = metrics["steps"]
    codes = {name: i for i, name in enumerate(STATES)}
    grid = np.zeros((n_req, len(steps)), dtype=np.uint8)
    for col, step in enumerate(steps):
        for idx, state in (step.get("states") or {}).items():
            row = int(idx)
            if row < n_req:
                grid[row, col] = codes.get(state, 0)
    # The engine leaves out "waiting before first admission": it is every step from the
    # request's arrival up to the first step that shows it.
    step_numbers = np.array([int(step.get("step", col)) for col, step in enumerate(steps)])
    for row, req in enumerate(metrics["requests"][:n_req]):
        arrival = req.get("arrival_step")
        if arrival is None:
            continue
        seen = np.flatnonzero(grid[row])
        first = int(seen[0]) if seen.size else len(steps)
        span = (step_numbers[:first] > int(arrival)) & (grid[row, :first] == 0)
        grid[row, :first][span] = codes["waiting"]
    return grid


def timeline_figure(metrics: MetricsFile) -> Figure:
    grid = state_matrix(metrics)
    n_req, n_steps = grid.shape
    edges = _step_edges(metrics)
    fig, ax = _figure(min(14.0, max(3.0, 1.8 + 0.22 * n_req)), bottom_in=1.1)
    cmap = ListedColormap(COLORS)
    norm = BoundaryNorm(np.arange(len(STATES) + 1) - 0.5, cmap.N)
    # extent puts step k's column over x = k .. k+1 and request 0 on the top row.
    ax.imshow(
        grid,
        cmap=cmap,
        norm=norm,
        aspect="auto",
        interpolation="nearest",
        extent=(edges[0], edges[-1], n_req, 0),
    )
    if n_req <= 60:
        ids = [str(r["id"])[:14] for r in metrics["requests"][:n_req]]
        ax.set_yticks(np.arange(n_req) + 0.5, ids, fontsize=8)
        # Thin separators so adjacent rows in the same state stay distinguishable.
        ax.hlines(np.arange(1, n_req), edges[0], edges[-1], colors="white", linewidth=0.8)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("engine step")
    total = len(metrics["requests"])
    shown = f" (first {n_req} of {total} requests)" if n_req < total else ""
    ax.set_title(f"Schedule: state of each request at each step{shown}")
    handles = [Patch(facecolor=COLORS[i], edgecolor="#555555", label=LABELS[s])
               for i, s in enumerate(STATES) if s in LABELS]  # fmt: skip
    # Legend in the bottom margin, below the x label, so it never covers a request.
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02),
               ncol=len(handles), frameon=False, fontsize=9)  # fmt: skip
    return fig


def hit_rate_figure(metrics: MetricsFile) -> Figure:
    steps = metrics["steps"]
    rate = [
        100.0 * s["hit_tokens_cum"] / s["query_tokens_cum"] if s["query_tokens_cum"] else np.nan
        for s in steps
    ]
    edges = _step_edges(metrics)
    fig, ax = _figure(3.2)
    ax.stairs(rate, edges, baseline=None, color="#2ca02c", linewidth=1.8)  # no drop to 0
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, 100)
    ax.set_xlabel("engine step")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Cumulative prefix-cache hit rate (hit tokens / query tokens)")
    ax.grid(alpha=0.3)
    return fig


def tokens_figure(metrics: MetricsFile) -> Figure:
    steps = metrics["steps"]
    prefill = np.array([s.get("num_prefill_tokens", 0) for s in steps], dtype=float)
    decode = np.array([s.get("num_decode_tokens", 0) for s in steps], dtype=float)
    edges = _step_edges(metrics)
    fig, ax = _figure(3.2)
    # Filled stairs instead of bars: one artist each, so 10,000-step runs draw quickly.
    ax.stairs(prefill, edges, fill=True, color="#ff7f0e", label="prefill (computed)")
    ax.stairs(prefill + decode, edges, baseline=prefill, fill=True, color="#1f77b4",
              label="decode")  # fmt: skip
    budget = metrics.get("max_num_batched_tokens") or 0
    peak = max(float((prefill + decode).max()) if steps else 0.0, 1.0)
    title = "Tokens computed per step"
    # A budget far above the peak would flatten every bar to the axis: name it instead.
    if budget and budget <= 2 * peak:
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label="token budget")
        peak = max(peak, budget)
    elif budget:
        title += f" (token budget {budget:,} per step, above this scale)"
    ax.set_ylim(0, peak * 1.3)  # headroom so the legend sits above the bars
    ax.set_title(title)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", ncol=3, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _table_html(header: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{html.escape(c)}</td>'
            if i in numeric
            else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def request_rows(metrics: MetricsFile) -> list[list[str]]:
    return [
        [
            str(r["id"]),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r["output_tokens"]),
            _ms(r.get("ttft_s")),
            str(r.get("num_preemptions", 0)),
            str(r.get("finish_reason") or "-"),
        ]
        for r in metrics["requests"][:MAX_REQUEST_ROWS]
    ]


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 8px 0; }
.meta { color: #555; }
"""


def render_html(metrics: MetricsFile) -> str:
    """The whole page as a string; every image is inline, nothing is fetched."""
    esc = html.escape
    model = str(metrics.get("model", "?"))
    batching = str(metrics.get("batching", "?"))
    caching = "on" if metrics.get("enable_prefix_caching", True) else "off"
    title = f"kvcache report: {batching} batching, {model}"
    meta = (
        f"prefix caching {caching} · block size {metrics.get('block_size', '?')} · "
        f"{metrics.get('num_kv_blocks', '?')} KV blocks · token budget "
        f"{metrics.get('max_num_batched_tokens', '?')} per step"
    )
    summary = _table_html(["metric", "value"], [list(r) for r in summary_rows(metrics)], set())
    groups = [
        [g.prefix_key[:16] or NO_PREFIX, str(g.num_requests), f"{g.prompt_tokens:,}",
         f"{g.cached_tokens:,}", f"{g.hit_rate:.1%}", g.preview]
        for g in prefix_breakdown(metrics)
    ]  # fmt: skip
    breakdown = _table_html(
        ["prefix", "requests", "prompt tokens", "cached tokens", "hit rate", "preview"],
        groups,
        {1, 2, 3, 4},
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1><p class='meta'>{esc(meta)}</p>",
        "<h2>Summary</h2>",
        summary,
    ]
    timing = [list(time_cells(r)) for r in time_breakdown(metrics["steps"])]
    if timing:
        parts += ["<h2>Where the time went</h2>", _table_html(list(TIME_HEADER), timing, set())]
    if metrics["steps"]:
        figures = [
            ("Schedule timeline", timeline_figure(metrics)),
            ("Cache hit rate over time", hit_rate_figure(metrics)),
            ("Tokens per step", tokens_figure(metrics)),
        ]
        if is_pd_run(metrics):  # both workers' steps on one clock, first: the run's picture
            figures.insert(0, ("Prefill and decode workers", pd_timeline_figure(metrics)))
        step_parts = step_parts_ms(metrics["steps"])
        if step_parts is not None:
            fig, ax = _figure(3.2)
            draw_step_parts(ax, step_parts, _step_edges(metrics))
            figures.append(("Step time", fig))
        for heading, fig in figures:
            parts.append(f"<h2>{esc(heading)}</h2>")
            parts.append(f'<img alt="{esc(heading)}" src="data:image/png;base64,{_png(fig)}">')
    else:
        parts.append("<p>No engine steps were recorded, so there is no schedule to draw.</p>")
    parts += ["<h2>By shared prefix</h2>", breakdown]
    n = len(metrics["requests"])
    shown = f" (first {MAX_REQUEST_ROWS} of {n})" if n > MAX_REQUEST_ROWS else ""
    parts.append(f"<h2>Requests{esc(shown)}</h2>")
    parts.append(
        _table_html(
            ["id", "prompt", "cached", "output", "TTFT (ms)", "preemptions", "finish"],
            request_rows(metrics),
            {1, 2, 3, 4, 5},
        )
    )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(metrics: MetricsFile, path: Path) -> None:
    Path(path).write_text(render_html(metrics), encoding="utf-8")
