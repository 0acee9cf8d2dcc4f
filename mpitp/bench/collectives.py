"""Collective benchmark in the nccl-tests / OSU style, every algorithm side by side.

For each size and algorithm: ``warmup`` untimed calls, then ``iters`` timed calls between
barriers, ``trials`` times (interleaved across the algorithms); the time of one call is
the per-rank median over trials of the per-call average, reported as avg/min/max over
ranks (OSU) and as algbw = bytes / time, busbw = algbw x factor (nccl-tests):

    allreduce 2(n-1)/n    reduce_scatter, allgather, alltoall (n-1)/n
    broadcast, reduce, gather, scatter 1

``size`` is the per-rank buffer for allreduce/reduce/broadcast, the full (gathered or
scattered) buffer otherwise, as in nccl-tests. Inputs are small integers so every sum
is exact and ``--check`` can count wrong elements without tolerance.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from ..comm.algorithms.select import ALGORITHMS
from ..units import human, parse_size  # noqa: F401  (re-exported for the CLI)

BUSBW = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "gather": lambda n: 1.0,
    "scatter": lambda n: 1.0,
}
COLLECTIVES = tuple(BUSBW)
REDUCING = ("allreduce", "reduce_scatter", "reduce")


@dataclass
class Row:
    collective: str
    algorithm: str
    size_bytes: int
    count: int
    dtype: str
    op: str
    ranks: int
    time_us: float
    min_us: float
    max_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def sizes(lo: int, hi: int, factor: float) -> list[int]:
    out, s = [], float(max(lo, 1))
    while s <= hi:
        out.append(int(s))
        s = s * factor if factor > 1 else hi + 1
    return out


class Case:
    """Buffers and one call of a collective at one size, reused across iterations."""

    def __init__(self, comm, collective: str, nbytes: int, dtype, op: str, algorithm: str, inplace: bool, xp=np):
        self.comm, self.coll, self.op, self.alg, self.inplace = comm, collective, op, algorithm, inplace
        n, r = comm.size, comm.rank
        dtype = np.dtype(dtype)
        count = max(nbytes // dtype.itemsize, 0)
        if collective in ("allgather", "gather"):  # size = the gathered whole
            per_rank = count // n
            count = per_rank * n
        elif collective == "alltoall":  # equal blocks per peer
            count -= count % n
            per_rank = count
        else:  # size = each rank's input
            per_rank = count
        self.count = count
        self.x = xp.asarray(((np.arange(per_rank) + r) % 7).astype(dtype))
        self.out = xp.empty_like(self.x) if collective == "allreduce" and not inplace else None
        self.call = self._bind()

    def _bind(self):
        """The call with its arguments bound once, as a closure: a timed iteration is one
        Python call, as for the references below, so the harness adds the same to every
        row (a ``functools.partial`` with keywords would build a dict on every call)."""
        c, alg, x, op = self.comm, self.alg, self.x, self.op
        out = x if self.inplace else self.out
        if self.coll == "allreduce":
            f = c.allreduce
            return lambda: f(x, op, out=out, algorithm=alg)
        if self.coll == "reduce_scatter":
            return lambda: c.reduce_scatter(x, op, algorithm=alg)
        if self.coll == "allgather":
            return lambda: c.allgather(x, algorithm=alg)
        if self.coll == "reduce":
            red = x if self.inplace else None
            return lambda: c.reduce(x, op, 0, out=red, algorithm=alg)
        if self.coll == "broadcast":
            return lambda: c.broadcast(x, 0)
        if self.coll == "gather":
            return lambda: c.gather(x, 0)
        if self.coll == "scatter":
            src = x if c.rank == 0 else None
            return lambda: c.scatter(src, 0)
        return lambda: c.alltoall(x)

    def __call__(self):
        return self.call()

    def expected(self):
        """What a correct result holds on this rank (None: nothing to check here)."""
        n, r = self.comm.size, self.comm.rank
        per = self.x.size
        base = [((np.arange(per) + q) % 7) for q in range(n)]
        if self.coll in REDUCING:
            fn = {
                "sum": np.add,
                "avg": np.add,
                "prod": np.multiply,
                "max": np.maximum,
                "min": np.minimum,
                "band": np.bitwise_and,
                "bor": np.bitwise_or,
                "bxor": np.bitwise_xor,
            }[self.op]
            total = base[0]
            for b in base[1:]:
                total = fn(total, b)
            if self.op == "avg":
                total = total / n
            if self.coll == "reduce_scatter":
                return np.array_split(total, n)[r]
            return total if (self.coll == "allreduce" or r == 0) else None
        if self.coll == "broadcast":
            return base[0]
        if self.coll in ("gather", "allgather"):
            return np.concatenate(base) if (self.coll == "allgather" or r == 0) else None
        if self.coll == "scatter":
            return np.array_split(base[0], n)[r]
        blocks = [np.split(b, n)[r] for b in base]  # alltoall
        return np.concatenate(blocks)


def count_wrong(case: Case, result) -> int:
    want = case.expected()
    if want is None or result is None:
        return 0
    got = result.get() if hasattr(result, "get") and not isinstance(result, np.ndarray) else np.asarray(result)
    want = want.astype(got.dtype)
    if got.shape != want.shape:
        return int(want.size)
    return int(np.count_nonzero(got.reshape(-1) != want.reshape(-1)))


def time_case(case, iters: int, warmup: int) -> float:
    """Seconds per call on this rank (calls between two barriers)."""
    call = case.call
    for _ in range(warmup):
        call()
    case.comm.mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    case.comm.mpi.Barrier()
    return (time.perf_counter() - t0) / iters


def iterations(nbytes: int, iters: int | None) -> int:
    """Timed calls per trial: 1000 for small messages (OSU uses 10000 below 8 KiB; a trial
    of a few-microsecond call must outlast the scheduler's hiccups), fewer for big ones
    so that a sweep stays in seconds."""
    if iters:
        return iters
    return int(min(1000, max(5, (256 << 20) // max(nbytes, 1) // 8)))


class MpiReference:
    """MPI's own all-reduce through mpi4py directly (no mpitp in the path): the "vs MPI"
    column's reference."""

    def __init__(self, comm, nbytes: int, dtype, op: str):
        from ..comm.mpi_types import ReduceOp, mpi_datatype, mpi_op

        dt = np.dtype(dtype)
        self.comm = comm
        self.x = (np.arange(nbytes // dt.itemsize) % 7).astype(dt)
        self.y = np.empty_like(self.x)
        mdt = mpi_datatype(dt)
        f, sx, sy, mop = comm.mpi.Allreduce, [self.x, mdt], [self.y, mdt], mpi_op(ReduceOp(op), dt)
        self.call = lambda: f(sx, sy, mop)


class MemcpyReference:
    """One copy of ``nbytes`` on this rank (every rank copying at once): the ceiling,
    timed between the same trials as the collectives."""

    def __init__(self, comm, nbytes: int):
        self.comm = comm
        self.a = np.ones(max(nbytes, 1), np.uint8)
        self.b = np.empty_like(self.a)
        a, b = self.a, self.b
        self.call = lambda: np.copyto(b, a)


def measure_size(
    comm,
    collective: str,
    nbytes: int,
    algorithms: list[str],
    *,
    dtype="float32",
    op="sum",
    iters: int | None = None,
    warmup: int = 2,
    check: bool = False,
    inplace: bool = False,
    xp=np,
    trials: int = 1,
    reference: bool = False,
    memcpy: bool = False,
) -> tuple[list[Row], float | None, float | None]:
    """One row per algorithm at one size, MPI's own time (``reference``, all-reduce) and
    the copy bandwidth in GB/s of ``nbytes`` on every rank at once (``memcpy``).

    Trials are interleaved — trial k times every algorithm (and the references) once
    before trial k+1 — so a slow spell of a shared machine hits all of them alike and
    the ratios between them stay meaningful; each time is the median over trials."""
    cases = [Case(comm, collective, nbytes, dtype, op, alg, inplace, xp) for alg in algorithms]
    references: dict[str, MpiReference | MemcpyReference] = {}
    if reference and collective == "allreduce" and comm.size > 1:
        references["mpi"] = MpiReference(comm, nbytes, dtype, op)
    if memcpy:
        references["memcpy"] = MemcpyReference(comm, nbytes)
    timed = [*cases, *references.values()]
    refs = {name: len(cases) + k for k, name in enumerate(references)}  # name -> index in timed
    wrong: list[int | None] = [None] * len(algorithms)
    if check:  # one fresh call, checked, before timing (in place modifies the input)
        for k, case in enumerate(cases):
            keep = case.x.copy()
            bad = count_wrong(case, case())
            case.x[...] = keep
            wrong[k] = int(comm.allreduce_object(bad))
    n = iterations(nbytes, iters)
    times: list[list[float]] = [[] for _ in timed]
    for k in range(max(1, trials)):
        for j, contender in enumerate(timed):
            times[j].append(time_case(contender, n, warmup if k == 0 else 0))
    per_rank = [comm.allgather_object(float(np.median(t))) for t in times]
    ref = float(np.mean(per_rank[refs["mpi"]])) if "mpi" in refs else None
    copy = nbytes / float(np.mean(per_rank[refs["memcpy"]])) / 1e9 if "memcpy" in refs else None
    rows = []
    for k, alg in enumerate(algorithms):
        ts = per_rank[k]
        avg, lo, hi = float(np.mean(ts)), min(ts), max(ts)
        data = cases[k].count * np.dtype(dtype).itemsize
        algbw = data / avg / 1e9 if avg > 0 else 0.0
        rows.append(
            Row(
                collective,
                alg,
                data,
                cases[k].count,
                np.dtype(dtype).name,
                op if collective in REDUCING else "none",
                comm.size,
                avg * 1e6,
                lo * 1e6,
                hi * 1e6,
                algbw,
                algbw * BUSBW[collective](comm.size),
                wrong[k],
            )
        )
    return rows, ref, copy


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 5, comm=None) -> float:
    """Single-core copy bandwidth (GB/s: bytes copied per second), best of ``reps``; with
    ``comm`` (an MPI communicator) its ranks start each copy together."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(reps):
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def algorithms_for(collective: str, requested: str | None) -> list[str]:
    """The algorithms of a comma list, checked against those this collective has; None:
    those of mpi, ring and auto it has."""
    have = ("auto",) + ALGORITHMS[collective]
    if requested is None:
        return [a for a in ("mpi", "ring", "auto") if a in have]
    wanted = [a.strip() for a in requested.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in have]
    if unknown or not wanted:
        raise ValueError(
            f"--algorithms {requested!r}: {collective} has {', '.join(have)}"
            + (f" (not {', '.join(unknown)})" if unknown else "")
        )
    return list(dict.fromkeys(wanted))
