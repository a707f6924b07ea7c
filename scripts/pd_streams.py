"""The three remedies for a prefill stalling decodes, side by side, from one run of the
pd_interference bench: each running decode stream's token times (one tick a token) with
chunked prefill off, on, and with prefill/decode disaggregation; the long prompts' arrivals
and first tokens marked. A gap in a row of ticks is a stall the stream's reader sees.

    kvcache bench --workload pd_interference --systems engine,engine-nochunk,engine-pd \\
        --json run.json
    python scripts/pd_streams.py run.json docs/pd_streams.svg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

ORDER = ("engine-nochunk", "engine", "engine-pd")
TITLES = {
    "engine-nochunk": "one engine, no chunking",
    "engine": "one engine, chunked prefill",
    "engine-pd": "prefill and decode workers",
}


def draw(results: list[dict[str, Any]]) -> Figure:
    by_name = {r["system"]: r for r in results}
    systems = [name for name in ORDER if name in by_name]
    end = max(t for r in results for s in r["streams"].values() for t in s["token_s"] or [0.0])
    fig = Figure(figsize=(11.0, 1.0 + 1.35 * len(systems)), layout="constrained")
    axes = fig.subplots(len(systems), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, systems, strict=True):
        result = by_name[name]
        decodes = [s for s in result["streams"].values() if s["kind"] == "decode"]
        rows = list(range(len(decodes)))
        ax.eventplot([s["token_s"] for s in decodes], lineoffsets=rows, colors="#1f77b4",
                     linelengths=0.7, linewidths=0.6)  # fmt: skip
        ax.set_ylim(-0.6, len(decodes) - 0.4)
        for stream in (s for s in result["streams"].values() if s["kind"] == "long"):
            ax.axvline(stream["sent_s"], color="#ff7f0e", linestyle="--", linewidth=1)
            if stream["token_s"]:
                ax.axvline(stream["token_s"][0], color="#ff7f0e", linewidth=1.5)
        ax.set_yticks(range(len(decodes)), [f"decode {i}" for i in range(len(decodes))],
                      fontsize=8)  # fmt: skip
        ax.set_xlim(0, end * 1.01)
        ax.set_title(
            f"{TITLES.get(name, name)}: ITL p50 {result['itl_p50_ms']:.0f} ms, "
            f"p99 {result['itl_p99_ms']:.0f} ms, max {result['itl_max_ms']:,.0f} ms",
            fontsize=10, loc="left",
        )  # fmt: skip
    axes[-1].set_xlabel(
        "seconds; a tick is a token of a running decode; orange: a long prompt sent (dashed)"
        " and its first token (solid)"
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the bench's --json file")
    parser.add_argument("out", type=Path, help="the picture (.svg or .png)")
    args = parser.parse_args()
    results = json.loads(args.run.read_text(encoding="utf-8"))
    draw(results).savefig(args.out, metadata={"Date": None} if args.out.suffix == ".svg" else None)


if __name__ == "__main__":
    main()
