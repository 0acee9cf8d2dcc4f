"""``MPITP_TIMELINE=FILE``: what every collective did and when, as a Chrome trace per rank.

One JSON file per rank (``FILE`` with ``{rank}`` replaced, or ``FILE.rank00003.json``),
in the Trace Event format that ``chrome://tracing`` and Perfetto open, as Horovod's
timeline writes::

    {"traceEvents": [
      {"name": "allreduce", "cat": "collective", "ph": "X", "ts": 1520.3, "dur": 140350.2,
       "pid": 0, "tid": 0, "args": {"algorithm": "hierarchical", "bytes": 16777216,
                                    "peer": "intra+inter", "phase": "forward", "seq": 7}},
      {"name": "ring step 0 (reduce-scatter)", "cat": "ring", "tid": 1, ...},
      {"name": "piece 3 across nodes", "cat": "two-level", "tid": 2, ...}, ...]}

Row (``tid``) 0 holds the collectives, 1 the ring's steps, 2 and 3 the two-level
algorithm's pieces inside the node and across nodes. Times are microseconds from a
barrier taken when the first communicator is made, so the ranks' files line up; ``mpitp
timeline merge`` joins them into one (one process row per rank). Off by default; when
off, a collective pays one attribute test.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

_current: Timeline | None = None


class Timeline:
    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.events: list[dict] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str, cat: str, start: float, end: float, tid: int = 0, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": self.rank,
                "tid": tid,
                "ts": round((start - self.t0) * 1e6, 3),
                "dur": round((end - start) * 1e6, 3),
                "args": args,
            }
        )

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)


def rank_path(pattern: str, rank: int) -> Path:
    if "{rank}" in pattern:
        return Path(pattern.format(rank=rank))
    return Path(f"{pattern}.rank{rank:05d}.json")


def start(comm, pattern: str | None) -> Timeline | None:
    """The process's timeline: made (collectively, on ``comm``) by the first communicator
    when ``pattern`` (MPITP_TIMELINE) is set; written when the process exits."""
    global _current
    if _current is None and pattern:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
        path = rank_path(pattern, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        comm.Barrier()  # every rank's zero at the same moment
        _current = Timeline(path, rank)
        atexit.register(_current.write)
    return _current


def traced(steps, tl: Timeline, name: str, comm, algorithm: str, nbytes: int):
    """``steps`` of one collective, recorded as one span when they end."""
    before = dict(comm.traffic.by_peer)
    start = tl.now()
    result = yield from steps
    after = comm.traffic.by_peer
    peers = sorted(p for p in after if after[p] != before.get(p, 0))
    tl.span(
        name,
        "collective",
        start,
        tl.now(),
        algorithm=algorithm,
        bytes=nbytes,
        peer="+".join(peers) or "none",
        phase=comm.traffic.current_phase,
        seq=comm._seq,
    )
    return result


def merge(files: list[Path], out: Path) -> int:
    """Join per-rank traces into one file; returns the number of events."""
    events: list = []
    for f in files:
        events.extend(json.loads(f.read_text())["traceEvents"])
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return sum(1 for e in events if e.get("ph") == "X")
