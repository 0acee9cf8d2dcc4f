"""How close the ring all-reduce is to the memory work it cannot avoid, and what that
work allows against MPI's own call.

    mpiexec -n 2 python benchmarks/allreduce_floor.py --sizes 16M,64M

On one node a ring all-reduce of n bytes makes every rank take in 2(N-1)/N * n bytes
from its neighbour and add (N-1)/N * n of them to its own data. The "floor" row does
exactly that memory work on each rank at the same time, but with every transfer a plain
local copy (stand-in buffers of the neighbour's data in the rank's own memory), in the
ring's order and segment size: no messages, no waiting, no system calls. Interleaved
trials of MPI's own Allreduce, the ring and the floor give, per size:

    MPI/ring    what mpitp bench prints as "vs MPI"
    MPI/floor   an upper bound on MPI/ring for any algorithm: a real one does this work
                and also moves the data between cores
    ring/floor  what the ring pays for its transport: the crossing between cores (cache
                lines another core wrote, or memory), CMA's page pinning, flags, waits

Buffers that fit in cache make the floor all-cache (small sizes): read the large rows.
"""

import argparse
import time

import numpy as np

import mpitp
from mpitp.bench.collectives import human
from mpitp.comm.algorithms import ring
from mpitp.comm.algorithms.tuning import library_version
from mpitp.split import chunk_counts, offsets
from mpitp.units import size_list


def floor_work(r: int, N: int, x, y, left_x, left_y, seg: int):
    """The ring's memory work on rank r: N-1 reduce steps (copy the left neighbour's part
    of a chunk in, add this rank's part), then N-1 copies of reduced chunks."""
    counts = chunk_counts(x.size, N)
    offs = offsets(counts)

    def run():
        for s in range(N - 1):
            c = ring.recv_chunk(N, r, s)
            for lo in range(offs[c], offs[c] + counts[c], seg):
                hi = min(lo + seg, offs[c] + counts[c])
                np.copyto(y[lo:hi], left_x[lo:hi])
                np.add(x[lo:hi], y[lo:hi], out=y[lo:hi])
        for s in range(N - 1, 2 * N - 2):
            c = ring.recv_chunk(N, r, s)
            np.copyto(y[offs[c] : offs[c] + counts[c]], left_y[offs[c] : offs[c] + counts[c]])

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", type=size_list, default="4M,16M,64M", help="bytes per rank, comma separated (4M, 64M ...)"
    )
    ap.add_argument("--trials", type=int, default=9, help="interleaved trials; medians count (default 9)")
    args = ap.parse_args()
    comm = mpitp.Communicator()
    mpi = comm.mpi
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"# {comm.size} rank(s), float32 sum, {library_version()}")
    say(
        f"# {'size':>8} {'MPI ms':>8} {'ring ms':>8} {'floor ms':>9} {'MPI/ring':>9} {'MPI/floor':>10} "
        f"{'ring/floor':>11}"
    )
    for nbytes in args.sizes:
        n = nbytes // 4
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        left_x, left_y = np.ones_like(x), np.ones_like(x)
        # the segment the ring's transport uses at this size (CMA above the shared-memory limit)
        seg_bytes = comm.cma_segment_bytes if nbytes > comm.shm_max_bytes else comm.segment_bytes
        contenders = {
            "mpi": lambda x=x, y=y: mpi.Allreduce(x, y),
            "ring": lambda x=x, y=y: comm.allreduce(x, out=y, algorithm="ring"),
            "floor": floor_work(comm.rank, comm.size, x, y, left_x, left_y, max(1, seg_bytes // 4)),
        }
        iters = max(3, min(100, (256 << 20) // max(nbytes, 1) // 2))
        times = {k: [] for k in contenders}
        for _ in range(args.trials):
            for k, f in contenders.items():
                f()
                mpi.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    f()
                mpi.Barrier()
                times[k].append((time.perf_counter() - t0) / iters)
        med = {k: float(np.mean(mpi.allgather(float(np.median(v))))) for k, v in times.items()}
        say(
            f"  {human(nbytes):>8} {med['mpi'] * 1e3:8.2f} {med['ring'] * 1e3:8.2f} {med['floor'] * 1e3:9.2f} "
            f"{med['mpi'] / med['ring']:8.2f}x {med['mpi'] / med['floor']:9.2f}x {med['ring'] / med['floor']:10.2f}x"
        )
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
