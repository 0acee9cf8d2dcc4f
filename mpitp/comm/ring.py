"""Hand-written ring reduce-scatter, all-gather and all-reduce.

The flat buffer of ``n`` elements is cut into ``N`` chunks whose sizes differ by at most
one (``numpy.array_split``); rank ``r`` ends the reduce-scatter owning chunk ``r``::

    N = 3, chunks c0 c1 c2        step 0                  step 1
    rank 0 sends c2, gets c1      c1 += from rank 2       c0 += from rank 2   -> owns c0
    rank 1 sends c0, gets c2      c2 += from rank 0       c1 += from rank 0   -> owns c1
    rank 2 sends c1, gets c0      c0 += from rank 1       c2 += from rank 1   -> owns c2

At step ``s`` rank ``r`` sends chunk ``(r-s-1) mod N`` to ``r+1`` and reduces chunk
``(r-s-2) mod N`` received from ``r-1``. The all-gather then circulates each owned chunk
unchanged for N-1 steps, so every rank ends with bit-identical results. All-reduce is
the two together: 2(N-1) steps, and each rank sends ``2n - |c_r| - |c_{r+1}|`` elements.

Receives are posted before sends, and each chunk travels in segments so that reducing
segment k overlaps the transfer of segment k+1. The functions are generators of MPI
requests (see :mod:`mpitp.comm.handle`); they only need arrays that slice like NumPy's,
so CuPy device buffers work the same way when MPI is CUDA-aware.
"""
from __future__ import annotations

from typing import Any, Callable

from mpi4py import MPI

from .handle import Steps

Reduce = Callable[[Any, Any, Any], Any]          # reduce(a, b, out)
OnSend = Callable[[int, int], None]              # on_send(nbytes, peer)


def chunk_counts(n: int, parts: int) -> list[int]:
    """``numpy.array_split`` sizes: the first ``n % parts`` chunks get one extra element."""
    q, rem = divmod(n, parts)
    return [q + (1 if i < rem else 0) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _segments(count: int, seg: int):
    for lo in range(0, count, seg):
        yield lo, min(count, lo + seg)


def reduce_scatter(
    comm: MPI.Comm, src, dst, counts: list[int], reduce: Reduce, tmp, *,
    dtype: MPI.Datatype, itemsize: int, seg: int, tag: int, on_send: OnSend,
) -> Steps:
    """Ring reduce-scatter of flat ``src`` into flat ``dst`` (may be the same buffer).

    Afterwards ``dst[chunk rank]`` holds the reduction over all ranks; the other chunks of
    ``dst`` hold partial sums. ``tmp`` must hold ``max(counts)`` elements.
    """
    N, r = comm.size, comm.rank
    if N == 1:
        if dst is not src:
            dst[:] = src
        return
    right, left = (r + 1) % N, (r - 1) % N
    offs = offsets(counts)
    for s in range(N - 1):
        sc, rc = (r - s - 1) % N, (r - s - 2) % N
        send_from = src if s == 0 else dst
        so, ro, rn = offs[sc], offs[rc], counts[rc]
        rreqs = [
            comm.Irecv([tmp[lo:hi], dtype], source=left, tag=tag)
            for lo, hi in _segments(rn, seg)
        ]
        sreqs = []
        for lo, hi in _segments(counts[sc], seg):
            sreqs.append(comm.Isend([send_from[so + lo:so + hi], dtype], dest=right, tag=tag))
            on_send((hi - lo) * itemsize, right)
        for req, (lo, hi) in zip(rreqs, _segments(rn, seg)):
            yield req
            reduce(src[ro + lo:ro + hi], tmp[lo:hi], dst[ro + lo:ro + hi])
        yield sreqs


def all_gather(
    comm: MPI.Comm, buf, counts: list[int], *,
    dtype: MPI.Datatype, itemsize: int, tag: int, on_send: OnSend,
) -> Steps:
    """Ring all-gather, in place: on entry ``buf[chunk rank]`` is this rank's piece."""
    N, r = comm.size, comm.rank
    right, left = (r + 1) % N, (r - 1) % N
    offs = offsets(counts)
    for s in range(N - 1):
        sc, rc = (r - s) % N, (r - s - 1) % N
        reqs = []
        if counts[rc]:
            reqs.append(comm.Irecv([buf[offs[rc]:offs[rc] + counts[rc]], dtype], source=left, tag=tag))
        if counts[sc]:
            reqs.append(comm.Isend([buf[offs[sc]:offs[sc] + counts[sc]], dtype], dest=right, tag=tag))
            on_send(counts[sc] * itemsize, right)
        yield reqs


def all_reduce(
    comm: MPI.Comm, src, dst, reduce: Reduce, tmp, *,
    dtype: MPI.Datatype, itemsize: int, seg: int, tag: int, on_send: OnSend,
) -> Steps:
    """Ring all-reduce of flat ``src`` into flat ``dst`` (``dst is src`` for in place)."""
    counts = chunk_counts(dst.size, comm.size)
    kw = dict(dtype=dtype, itemsize=itemsize, tag=tag, on_send=on_send)
    yield from reduce_scatter(comm, src, dst, counts, reduce, tmp, seg=seg, **kw)
    yield from all_gather(comm, dst, counts, **kw)
    return dst
