"""Gather, all-gather, scatter and all-to-all: axis-0 concatenation and
``numpy.array_split`` pieces, per-rank first dimensions allowed to differ."""

from __future__ import annotations

import numpy as np

from .. import backend, split
from ..errors import CollectiveMismatchError
from .algorithms import mpi_collectives, ring, select
from .base import CommunicatorBase
from .handle import Steps
from .mpi_types import mpi_datatype

GATHER_MAX = 2 << 20  # bytes a rank's part of allgather_columns may hold (its window: 4x that a rank)


class Gathers(CommunicatorBase):
    def _rows(self, a) -> tuple[int, tuple, int]:
        """(rows, trailing shape, elements per row) for axis-0 concatenation."""
        shape = tuple(a.shape) or (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        return shape[0], shape[1:], row

    def _all_row_counts(self, rows: int) -> list[int]:
        """Every rank's row count, on every rank."""
        every = np.empty(self.size, np.int64)
        self.watchdog.wait([self.mpi.Iallgather(np.array([rows], np.int64), every)], "allgather of row counts")
        return every.tolist()

    def _root_row_counts(self, rows: int, root: int) -> list[int] | None:
        """Every rank's row count, on ``root`` (None elsewhere)."""
        mine = np.array([rows], np.int64)
        every = np.empty(self.size, np.int64)
        self.watchdog.wait(
            [self.mpi.Igather(mine, every if self.rank == root else None, root=root)], "gather of row counts"
        )
        return every.tolist() if self.rank == root else None

    def gather(self, x, root: int = 0, *, nonblocking: bool = False):
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (``None`` elsewhere)."""
        seq, label = self._begin("gather")

        def prep():
            self._check_root(root)
            return self._array(x)

        sig = lambda: self._sig("gather", x, root=root, trailing=tuple(getattr(x, "shape", ()))[1:])  # noqa: E731
        a = self._prepare(label, sig, ("collective", "dtype", "trailing", "root"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        rows, trailing, row = self._rows(src)
        counts = self._root_row_counts(rows, root)
        dst = None
        if counts is not None:  # the root
            dst = (np.empty if staged else lambda s, d: backend.empty(s, d, a))((sum(counts),) + trailing, a.dtype)
        self._record_mpi("gather", 0 if self.rank == root else src.nbytes)
        elems = None if counts is None else [c * row for c in counts]
        steps = mpi_collectives.gatherv(
            self.mpi, src, dst, elems, mpi_datatype(a.dtype), root, self._call_blocking(nonblocking)
        )
        return self._run(self._back_to_device(steps, x, None) if staged else steps, label, nonblocking)

    def allgather(self, x, *, out=None, algorithm: str = "auto", nonblocking: bool = False):
        """Concatenate every rank's ``x`` along axis 0 on every rank."""
        seq, label = self._begin("allgather")
        sig = lambda: self._sig("allgather", x, algorithm=algorithm, trailing=tuple(getattr(x, "shape", ()))[1:])  # noqa: E731

        def prep():
            a = self._array(x)
            return a, select.choose(
                "allgather", algorithm, a.nbytes * self.size, self.size, None, self.topology, self.tuning
            )

        a, alg = self._prepare(label, sig, ("collective", "dtype", "trailing", "algorithm"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        rows, trailing, row = self._rows(src)
        if out is not None and tuple(out.shape) == (rows * self.size,) + trailing and not self.validate:
            counts = [rows] * self.size  # out's shape says every rank has ``rows``: no count exchange
        else:
            counts = self._all_row_counts(rows)
        shape = (sum(counts),) + trailing
        dst = np.empty(shape, a.dtype) if staged else self._out_buffer(out, a, shape)
        elems = [c * row for c in counts]
        dt = mpi_datatype(a.dtype)
        if alg == "ring" and self.size > 1:
            steps = self._ring_allgather(src, dst, elems, seq, nonblocking)
        else:
            self._record_mpi("allgather", src.nbytes if self.size > 1 else 0)
            steps = mpi_collectives.allgatherv(self.mpi, src, dst, elems, dt, self._call_blocking(nonblocking))
        if staged:
            steps = self._back_to_device(steps, x, out)
        res = self._run(steps, f"{label} ({alg})", nonblocking, alg, dst.nbytes)
        return res if nonblocking or staged else self._finish(res, out)

    def allgather_columns(self, y, sizes=None):
        """Every rank's ``y`` [..., n_rank] side by side along the last axis, ranks in order
        (``sizes``: each rank's n, every rank's list the same; default equal): a model's
        logits, cut by the vocabulary. On one node, host arrays of at most GATHER_MAX bytes
        a rank go through a one-shot window (:mod:`.algorithms.oneshot`): each rank's part
        copied in once and out once straight into its columns, where MPI's all-gather and
        the concatenation after it cost 0.39-0.49 + 0.18-0.21 ms for a batch-8 step's
        2 x 786 KB (the default model, TP=2, measured inside a step). Elsewhere MPI's."""
        xp = backend.xp_of(y)
        shot = self._gather_shot(y, sizes)
        if shot:
            seq, label = self._begin("allgather")
            y2 = np.ascontiguousarray(y).reshape(-1, y.shape[-1])
            widths = [y.shape[-1]] * self.size if sizes is None else list(sizes)
            offs = np.zeros(self.size + 1, np.int64)
            offs[1:] = np.cumsum(widths)
            out = np.empty((y2.shape[0], int(offs[-1])), y.dtype)
            shot.label = f"{label} (oneshot, {y2.nbytes} bytes)"
            shot.allgather_columns(y2, out, offs)
            if y2.nbytes:
                self.traffic.record(y2.nbytes * (self.size - 1), "allgather", "intra")
            return out.reshape(*y.shape[:-1], out.shape[1])
        if sizes is None or len(set(sizes)) == 1:
            y = xp.ascontiguousarray(y)
            full = backend.empty((self.size * y.shape[0],) + tuple(y.shape[1:]), y.dtype, y)
            self.allgather(y, out=full)  # equal shards: out's shape spares the count exchange
            return xp.concatenate(list(full.reshape((self.size,) + tuple(y.shape))), axis=-1)
        part = xp.moveaxis(y, -1, 0)
        full = self.allgather(part)
        return xp.moveaxis(full, 0, -1)

    def _gather_shot(self, y, sizes):
        """The one-shot window for :meth:`allgather_columns`, or None: the same answer on
        every rank (what it looks at is the same on all). Opens it on the first call that
        may use it: collective."""
        widest = y.shape[-1] if sizes is None else max(sizes)
        if (
            self.size == 1
            or type(y) is not np.ndarray
            or y.dtype not in (np.float32, np.float64)
            or self.oneshot_max == 0
            or self.topology.num_nodes > 1
            or (y.size // max(y.shape[-1], 1)) * widest * y.itemsize > GATHER_MAX
        ):
            return None
        self._gathershot = self._open_window(self._gathershot, GATHER_MAX, "all-gather", gather=True)
        if not self._gathershot or self._gathershot.oversubscribed:
            return None  # more ranks than cores: MPI's call waits better than spinning ranks
        return self._gathershot

    def _ring_allgather(self, src, dst, elems, seq, nonblocking: bool) -> Steps:
        flat = dst.reshape(-1)
        lo = sum(elems[: self.rank])
        flat[lo : lo + elems[self.rank]] = src.reshape(-1)
        link = self._ring_transport(src, dst.nbytes, nonblocking, f"allgather #{seq}")
        yield from ring.all_gather(link, flat, elems, self._wire(src.dtype, seq, "allgather"))
        return dst

    def scatter(self, x, root: int = 0, *, nonblocking: bool = False):
        """Split root's ``x`` along axis 0 like ``numpy.array_split``; rank r gets piece r.
        Non-roots may pass ``None``."""
        seq, label = self._begin("scatter")
        sig = lambda: {"collective": "scatter", "root": root}  # noqa: E731

        def prep():
            self._check_root(root)
            if self.rank == root:
                a = self._array(x)
                if a.ndim == 0:
                    raise ValueError("scatter needs an array with at least one dimension")
                return a
            return None

        a = self._prepare(label, sig, ("collective", "root"), prep)
        staged = a is not None and self._via_host(a)
        src = self._to_host(a) if staged else a
        meta = (tuple(src.shape), src.dtype.str, staged) if self.rank == root else None
        shape, dtype, staged_root = self.mpi.bcast(meta, root=root)
        dtype = np.dtype(dtype)
        counts = split.chunk_counts(shape[0], self.size)
        row = int(np.prod(shape[1:], dtype=np.int64))
        like = x if (self.rank == root and not staged) else None
        dst = (
            backend.empty((counts[self.rank],) + tuple(shape[1:]), dtype, like)
            if like is not None
            else np.empty((counts[self.rank],) + tuple(shape[1:]), dtype)
        )
        if self.rank == root:
            self._record_mpi("scatter", src.nbytes - counts[root] * row * dtype.itemsize)
        steps = mpi_collectives.scatterv(
            self.mpi, src, dst, [c * row for c in counts], mpi_datatype(dtype), root, self._call_blocking(nonblocking)
        )
        if staged:
            steps = self._back_to_device(steps, x, None)
        return self._run(steps, label, nonblocking)

    def alltoall(self, x, *, nonblocking: bool = False):
        """Split axis 0 into ``size`` equal blocks; block j goes to rank j, and the
        result stacks the blocks received from ranks 0..size-1."""
        seq, label = self._begin("alltoall")
        sig = lambda: self._sig("alltoall", x)  # noqa: E731

        def prep():
            a = self._array(x)
            if a.ndim == 0 or a.shape[0] % self.size:
                raise ValueError(
                    f"alltoall needs axis 0 divisible by the communicator size {self.size}; got shape {tuple(a.shape)}"
                )
            return a

        a = self._prepare(label, sig, ("collective", "dtype", "shape"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        dst = np.empty_like(src) if staged else backend.empty(src.shape, src.dtype, a)
        self._record_mpi("alltoall", src.nbytes - src.nbytes // self.size)
        steps = mpi_collectives.alltoall(self.mpi, src, dst, mpi_datatype(a.dtype), self._call_blocking(nonblocking))
        if staged:
            steps = self._back_to_device(steps, x, None)
        return self._run(steps, label, nonblocking)

    def alltoallv(self, x, counts, *, sources=None, nonblocking: bool = False) -> tuple:
        """Rows of ``x`` grouped by destination, ``counts[j]`` of them (in order) to rank j:
        returns ``(rows, sources)``, the rows every rank sent here stacked by source rank and
        how many came from each. The counts go first, as an all-to-all of one int64 a rank,
        unless the caller gives ``sources`` (how many rows each rank sends here: known when
        this answers an earlier all-to-all the other way); any count may be 0 (a rank with
        nothing to send or receive still takes part). ``nonblocking``: ``rows`` is a
        :class:`~.handle.Handle` whose ``wait()`` gives them. The traffic counters record the
        rows this rank hands MPI for other ranks."""
        seq, label = self._begin("alltoallv")
        sig = lambda: self._sig("alltoallv", x, trailing=tuple(getattr(x, "shape", ()))[1:])  # noqa: E731

        def prep():
            a = self._array(x)
            c = [int(v) for v in counts]
            if a.ndim == 0 or len(c) != self.size or min(c) < 0 or sum(c) != a.shape[0]:
                raise ValueError(
                    f"alltoallv: counts {c} must give each of the {self.size} ranks a share of the "
                    f"{a.shape[0] if a.ndim else 0} rows of axis 0"
                )
            if sources is not None and (len(sources) != self.size or min(int(v) for v in sources) < 0):
                raise ValueError(
                    f"alltoallv: sources {list(sources)} must give a count for each of the {self.size} ranks"
                )
            return a

        a = self._prepare(label, sig, ("collective", "dtype", "trailing"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        rows, trailing, row = self._rows(src)
        send = np.asarray(counts, np.int64)
        if sources is None or self.validate:  # validating, the counts go anyway, to check sources
            recv = np.empty(self.size, np.int64)
            self.watchdog.wait([self.mpi.Ialltoall(send, recv)], "alltoall of row counts")
            if sources is not None:
                self._check_sources(label, recv, np.asarray(sources, np.int64))
        else:
            recv = np.asarray(sources, np.int64)
        shape = (int(recv.sum()),) + trailing
        dst = np.empty(shape, src.dtype) if staged else backend.empty(shape, src.dtype, a)
        self._record_mpi("alltoallv", int(rows - send[self.rank]) * row * src.itemsize)
        steps = mpi_collectives.alltoallv(
            self.mpi, src, (send * row).tolist(), dst, (recv * row).tolist(), mpi_datatype(a.dtype), False
        )
        if staged:
            steps = self._back_to_device(steps, x, None)
        return self._run(steps, label, nonblocking), recv.tolist()

    def _check_sources(self, label: str, sent_here, told) -> None:
        """Validation: every rank's ``sources`` against the rows the ranks send it; a mismatch
        raises the same CollectiveMismatchError on every rank (MPI would truncate or hang)."""
        n = self.size
        every = np.empty((n, 2 * n), np.int64)
        self.watchdog.wait([self.mpi.Iallgather(np.concatenate([sent_here, told]), every)], f"validation of {label}")
        for r in range(n):
            if not np.array_equal(every[r, :n], every[r, n:]):
                raise CollectiveMismatchError(
                    f"{label}: rank {r} was told sources {every[r, n:].tolist()}, but the ranks send it "
                    f"{every[r, :n].tolist()} rows"
                )
