"""``mpitp demo``: what every rank holds before and after each collective.

Rank r starts with ``[10r+1, 10r+2, ...]`` so every number tells where it came from;
rank 0 prints one table per collective, like the study notes mpitp
grew from (README, "The seeds' numbers").
"""

from __future__ import annotations

import numpy as np


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="print what each rank holds before/after every collective",
        description="Run every collective on tiny integer arrays and print, per rank, "
        "the input and the result. Try 'mpiexec -n 4 mpitp demo'.",
    )
    p.add_argument("--algorithm", default="auto", help="algorithm for all-reduce (auto, mpi, ring)")


def _table(comm, title: str, before, after) -> None:
    rows = comm.gather_object((_fmt(before), _fmt(after)))
    if comm.rank == 0:
        print(f"\n== {title}")
        print(f"   {'rank':<5} {'before':<28} after")
        for r, (b, a) in enumerate(rows):
            print(f"   {r:<5} {b:<28} {a}")


def _fmt(a) -> str:
    return "-" if a is None else np.array2string(np.asarray(a), separator=" ")


def run(args) -> int:
    from ..comm import Communicator

    with Communicator() as comm:  # freed however the command ends
        return _demo(args, comm)


def _demo(args, comm) -> int:
    r, n = comm.rank, comm.size
    x = np.arange(1, n + 1, dtype=np.int64) + 10 * r  # n elements, tagged by rank
    if r == 0:
        print(f"mpitp demo: {n} rank(s); rank r starts with [10r+1 .. 10r+{n}]")
    _table(comm, "gather(x, root=0)             rank 0 gets every x, concatenated", x, comm.gather(x, root=0))
    _table(comm, "reduce(x, 'sum', root=0)      rank 0 gets the element-wise sum", x, comm.reduce(x, root=0))
    _table(
        comm,
        f"allreduce(x, 'sum', algorithm={args.algorithm!r})  every rank gets the sum",
        x,
        comm.allreduce(x, algorithm=args.algorithm),
    )
    _table(comm, "allreduce(x, 'max')", x, comm.allreduce(x, op="max"))
    b = x.copy()
    _table(comm, "broadcast(x, root=0)          everyone gets rank 0's x", x, comm.broadcast(b, root=0))
    full = np.arange(1, 2 * n + 1, dtype=np.int64) * 100 if r == 0 else None
    _table(comm, "scatter(rank 0's [100..], root=0)  rank r gets piece r", full, comm.scatter(full, root=0))
    _table(comm, "allgather(x)                  every rank gets all x, concatenated", x, comm.allgather(x))
    _table(comm, "reduce_scatter(x, 'sum')      the sum, cut into one piece per rank", x, comm.reduce_scatter(x))
    _table(comm, "alltoall(x)                   element j of rank i goes to rank j", x, comm.alltoall(x))
    t = comm.traffic
    totals = comm.gather_object(t.total)
    if r == 0:
        print(f"\nbytes handed to MPI per rank: {totals}   (comm.traffic has the breakdown)")
    return 0
