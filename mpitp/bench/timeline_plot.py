"""A merged timeline drawn as a PNG: one band per rank, a row per kind of span."""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"collective": "#4c72b0", "ring": "#dd8452", "two-level": "#55a868"}


ROWS = 5  # per rank: collectives, ring steps, pieces in the node, pieces across nodes, a gap
SHORT = (
    (" reduce-scatter in node", " RS"),
    (" all-gather in node", " AG"),
    (" across nodes", " net"),
    ("piece ", "p"),
    ("ring step ", "s"),
    (" (reduce-scatter)", ""),
    (" (all-gather)", ""),
)


def plot(trace: Path, out: Path, collective: int | None = None) -> None:
    """Draw ``trace``; ``collective`` (an index into rank 0's collectives, -1 the last)
    zooms to that one call."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("mpitp timeline plot needs matplotlib: pip install 'mpitp[plot]'") from None
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    window = None
    if collective is not None:
        calls = [e for e in events if e["pid"] == min(x["pid"] for x in events) and e["tid"] == 0]
        lo = calls[collective]["ts"] - 0.02 * calls[collective]["dur"]
        hi = calls[collective]["ts"] + 1.02 * calls[collective]["dur"]
        events = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        window = (lo / 1e3, hi / 1e3)
    ranks = sorted({e["pid"] for e in events})
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 1.0 * len(ranks)))
    for e in events:
        y = ranks.index(e["pid"]) * ROWS + e.get("tid", 0)
        ms, dur = e["ts"] / 1e3, e["dur"] / 1e3
        ax.broken_barh([(ms, dur)], (y, 0.8), color=COLORS.get(e.get("cat"), "#888888"), edgecolor="white")
        if e["dur"] > 0.045 * (window[1] - window[0] if window else span / 1e3) * 1e3:
            label = e["name"]
            for long, short in SHORT:
                label = label.replace(long, short)
            ax.text(ms + dur / 2, y + 0.4, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks([i * ROWS + 1.9 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(
        handles,
        ["collective", "ring step", "two-level piece (node row, network row)"],
        loc="upper left",
        bbox_to_anchor=(0, 1.12),
        ncol=3,
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
