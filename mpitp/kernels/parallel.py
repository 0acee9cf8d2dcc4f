"""Threads inside a rank: each int8 matmul's output tiles split over N threads.

An MPI + OpenMP code runs one rank per socket (or node) and threads inside it; mpitp runs
one rank per core by default, or ``--threads N`` / ``MPITP_THREADS`` threads per rank.
The int8 kernels (:mod:`.int8`) are plain functions of pointers; here numba's parallel
loop (its OpenMP or workqueue pool, ~5 µs a launch) calls them on contiguous ranges of a
weight's tiles of 8 output rows, each range its own rows of y::

    tiles 0 .. T-1 of W      thread 0: tiles [0, T/N)   -> y[:, 0 .. 8T/N)
                             thread 1: tiles [T/N, 2T/N) -> ...

Every output row is computed by the same kernel on the same data whatever N is, so the
result is bit for bit the one-thread result. Prefill splits its column spans (each a
block of weight tiles kept in cache while every 16 rows of x pass over it) the same way.
With one thread (the default) none of this runs: the kernel is called directly.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np

from ..errors import MpitpError
from .calls import kernel_at


class ThreadsError(MpitpError, ValueError):
    """A thread count the kernels cannot run."""


MIN_WORK = 400  # tiles × blocks of 32 (256 weights each) per thread below which a matmul is not
# split: a launch of the pool costs ~2 µs (a Xeon's OpenMP pool), so the default model's qkv
# and o (2160 and 1296) split too (docs/measurements.md)


_CHOSEN: int | None = None  # --threads, which takes precedence over MPITP_THREADS


def set_threads(n: int | None) -> None:
    """Threads per rank from the command line (None: back to ``MPITP_THREADS``)."""
    global _CHOSEN
    _CHOSEN = None if n is None else check(n)


def threads(environ=None) -> int:
    """Threads per rank for the kernels: ``--threads`` (:func:`set_threads`), else
    ``MPITP_THREADS`` (default 1)."""
    from .. import settings

    if _CHOSEN is not None and environ is None:
        return _CHOSEN
    s = settings.current() if environ is None else settings.Settings.from_env(environ)
    return s.threads


def check(n: int) -> int:
    """``n`` if numba's pool can run that many threads, else a clear error."""
    if n < 1:
        raise ThreadsError(f"threads per rank must be at least 1, got {n}")
    if n > 1:
        top = numba.config.NUMBA_NUM_THREADS
        if n > top:
            raise ThreadsError(
                f"{n} threads per rank asked, but numba's pool has {top} (NUMBA_NUM_THREADS, the CPUs it saw): "
                f"set NUMBA_NUM_THREADS={n} to oversubscribe on purpose"
            )
    return n


# numba's threading layer, launched now in every process that imports the kernels. The
# fused decode halves and the matmul drivers call parallel functions (this module's
# tile_ranges, decode's per-head attention) on a branch taken only with threads, and so link
# their code, which names the pool's scheduler (allocate_sched). numba launches the pool
# when it compiles such a caller, or loads one from its cache that remembers to; a caller
# compiled while its parallel callee came from the cache does not remember (numba copies
# the callee's reload hooks only from a library it compiled in that process), and the next
# process that loaded it aborted: "LLVM ERROR: Symbol not found: allocate_sched". Seen on a
# second `mpiexec -n 2 mpitp generate` after the test suite had filled the cache. Launching
# costs ~1 ms and idle pool threads.
numba.get_num_threads()


@numba.njit(parallel=True, nogil=True, cache=True)
def tile_ranges(fn, parts, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm):
    """The kernel at ``fn`` over tiles 0..T-1 in ``parts`` contiguous ranges over numba's
    pool (``sq``, ``sd``, ``sm``: bytes a tile advances qs, d and m); each output row is
    the one-thread kernel's. Compiled on first use (only when threads > 1)."""
    for j in numba.prange(parts):
        t0 = T * j // parts
        t1 = T * (j + 1) // parts
        if t1 > t0:
            mj = m + t0 * sm if sm else m
            kernel_at(fn, qs + t0 * sq, d + t0 * sd, mj, xq, xd, xs, y + t0 * 32, t1 - t0, nb, M, ldy)


@lru_cache(maxsize=1)
def _drivers():
    """The parallel loops, compiled on first use (only when threads > 1)."""
    from numba import njit, prange

    @njit(parallel=True, nogil=True, cache=True)
    def spans(fns, span, rows, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm, xqr, xdr, xsr):
        for s in prange((T + span - 1) // span):
            _span(fns, s * span, span, rows, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm, xqr, xdr, xsr)

    return tile_ranges, spans


@numba.njit(nogil=True, cache=True)
def _span(fns, t0, span, rows, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm, xqr, xdr, xsr):
    """Tiles t0 .. t0+span-1 of W, every ``rows`` rows of x in turn (prefill's unit of work);
    ``fns[r]``: the kernel for a chunk of r rows (the last chunk may take a smaller one, and
    with ``fns[0]`` nonzero go in powers of two: :func:`.int8.prefill_kernels`)."""
    cnt = min(span, T - t0)
    mj = m + t0 * sm if sm else m
    r0 = 0
    while r0 < M:
        yo = y + (r0 * ldy + t0 * 8) * 4
        r = min(rows, M - r0)
        if fns[0] and r < rows:  # a tail: powers of two while its kernel would pad 2 rows or more
            R = 1
            while R < r:
                R *= 2
            if R - r >= 2:
                r = R // 2
        kernel_at(fns[r], qs + t0 * sq, d + t0 * sd, mj, xq + r0 * xqr, xd + r0 * xdr, xs + r0 * xsr, yo, cnt, nb,
                  r, ldy)  # fmt: skip
        r0 += r


@numba.njit(nogil=True, cache=True)
def _serial_spans(fns, span, rows, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm, xqr, xdr, xsr):
    """Prefill's spans in order on the calling thread, compiled (a Python loop costs ~8 µs
    a kernel call, ~0.25 s of a 476-token prefill on the 1B shape)."""
    for t0 in range(0, T, span):
        _span(fns, t0, span, rows, qs, d, m, xq, xd, xs, y, T, nb, M, ldy, sq, sd, sm, xqr, xdr, xsr)


def use(n: int) -> None:
    """Numba's pool runs ``n`` threads for the parallel loops this thread calls next."""
    numba.set_num_threads(n)


def run_tiles(fn: int, n: int, wp, tile_bytes, xp, y: int, T: int, nb: int, M: int, ldy: int) -> None:
    """The kernel at address ``fn`` (:mod:`.calls`) over tiles 0..T-1 in ``n`` contiguous
    ranges, one per thread."""
    numba.set_num_threads(n)
    _drivers()[0](fn, n, *wp, *xp, y, T, nb, M, ldy, *tile_bytes)


def run_spans(fns, n: int, span: int, rows: int, wp, tile_bytes, xp, x_row_bytes, y, T, nb, M, ldy) -> None:
    """Prefill: spans of ``span`` tiles over the threads, each span taking every ``rows``
    rows of x in turn (``x_row_bytes``: bytes of xq, xd and xs a row of x advances;
    ``fns``: int64 kernel addresses by the rows of a chunk, 0..rows); one thread runs them
    in order, without the parallel pool."""
    if n == 1:
        _serial_spans(fns, span, rows, *wp, *xp, y, T, nb, M, ldy, *tile_bytes, *x_row_bytes)
        return
    numba.set_num_threads(n)
    _drivers()[1](fns, span, rows, *wp, *xp, y, T, nb, M, ldy, *tile_bytes, *x_row_bytes)


def warm(fn: int, threads: int) -> None:
    """Compile the drivers now (at load), not inside the first forward: they run the
    kernel at address ``fn`` on zero tiles."""
    fns = np.full(17, fn, np.int64)
    fns[0] = 0
    _serial_spans(fns, 1, 16, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 8, 0, 0, 0, 0, 0, 0)
    if threads == 1:
        return
    tiles, spans = _drivers()
    tiles(fn, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 8, 0, 0, 0)
    spans(fns, 1, 16, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 8, 0, 0, 0, 0, 0, 0)
