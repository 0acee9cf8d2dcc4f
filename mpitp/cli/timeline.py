"""``mpitp timeline``: join the per-rank traces MPITP_TIMELINE wrote, or draw one."""

from __future__ import annotations

import glob
from pathlib import Path

from ..errors import MpitpError


class TimelineError(MpitpError, ValueError):
    """No trace files where the user pointed, or a file that is not a trace."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "timeline",
        help="merge or draw the traces MPITP_TIMELINE wrote",
        description="MPITP_TIMELINE=FILE makes every rank write FILE.rankNNNNN.json (Chrome trace "
        "format: chrome://tracing, ui.perfetto.dev). 'merge' joins them into one file, one row per "
        "rank; 'plot' draws a merged file as a PNG (needs matplotlib).",
    )
    ps = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = ps.add_parser("merge", help="join per-rank traces into one file")
    m.add_argument("traces", nargs="+", help="the MPITP_TIMELINE value, or the per-rank files")
    m.add_argument("-o", "--output", required=True, help="merged trace to write")
    d = ps.add_parser("plot", help="draw a trace as a PNG: one band per rank")
    d.add_argument("trace", help="a merged (or per-rank) trace")
    d.add_argument("-o", "--output", required=True, help="PNG to write")
    d.add_argument("--collective", type=int, help="zoom to rank 0's K-th collective (0 the first, -1 the last)")


def _files(args: list[str]) -> list[Path]:
    files: list[Path] = []
    for a in args:
        p = Path(a)
        found = [p] if p.is_file() else [Path(f) for f in sorted(glob.glob(f"{a}.rank*.json"))]
        if not found:
            raise TimelineError(f"{a}: no such trace, and no {a}.rank*.json")
        files += found
    return files


def run(args) -> int:
    from ..comm import timeline
    from ..log import get_logger

    if args.action == "merge":
        files = _files(args.traces)
        try:
            n = timeline.merge(files, Path(args.output))
        except (ValueError, KeyError) as e:
            raise TimelineError(f"not a Chrome trace among {', '.join(map(str, files))}: {e}") from None
        get_logger("timeline").info(f"{len(files)} rank(s), {n} events -> {args.output}")
        return 0
    from ..bench.timeline_plot import plot

    plot(Path(args.trace), Path(args.output), args.collective)
    return 0
