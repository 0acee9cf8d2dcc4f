"""``mpitp.Communicator``: every MPI collective on NumPy and CuPy arrays.

Conventions (the same on every rank):

* gather / allgather concatenate along axis 0 (per-rank first dimensions may differ;
  0-d arrays count as one row);
* scatter / reduce_scatter split axis 0 like ``numpy.array_split`` (pieces differ by at
  most one row);
* alltoall splits axis 0 into ``size`` equal blocks;
* ``out=`` receives the result; ``out=x`` is in place. Inputs of any shape, zero-size or
  non-contiguous (copied, never rejected);
* ``nonblocking=True`` returns a :class:`~mpitp.comm.handle.Handle`; ``h.wait()`` gives the
  result.

Device arrays are synchronized before MPI sees them; they go to MPI directly when MPI is
CUDA-aware and through host copies otherwise (:mod:`mpitp.backend`).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import backend
from ..errors import MpitpError
from . import hierarchical, native, ring, select, tuning, validate
from .handle import Completed, Handle, Steps, Watchdog, drive
from .ops import ReduceOp, check_dtype, check_reducible, mpi_datatype, mpi_op, ufunc
from .topology import Topology
from .traffic import Traffic
from .workspace import Workspace

_LOCAL_ERRORS = (MpitpError, ValueError, TypeError)
RING_DEPTH = int(os.environ.get("MPITP_RING_DEPTH", 4))   # receive segments in flight per ring step


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class Communicator:
    """A duplicated MPI communicator with array collectives, algorithms and counters.

    >>> comm = Communicator()                      # Dup of MPI.COMM_WORLD
    >>> y = comm.allreduce(x, op="sum")            # new array on every rank
    """

    def __init__(self, comm: "MPI.Comm | Communicator | None" = None, *, validate: bool | None = None,
                 timeout: float | None = None, ranks_per_node: int | None = None):
        base = comm.mpi if isinstance(comm, Communicator) else (comm or MPI.COMM_WORLD)
        self.mpi: MPI.Comm = base.Dup()            # user-visible traffic (collectives, p2p)
        self._algo: MPI.Comm = self.mpi.Dup()      # hand-written algorithms' messages
        self._meta: MPI.Comm = self.mpi.Dup()      # validation exchange
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.validate = _env_flag("MPITP_VALIDATE") if validate is None else bool(validate)
        self.watchdog = Watchdog.from_env(timeout, MPI.COMM_WORLD.rank)
        self.topology = Topology.detect(self.mpi, ranks_per_node)
        self.traffic = Traffic()
        self.segment_bytes = int(os.environ.get("MPITP_RING_SEGMENT", 512 * 1024))
        self._staging = None      # decided on first device array (asks MPI once)
        self._seq = 0
        self._workspace = Workspace()
        self._node_comms: hierarchical.NodeComms | None = None
        self._fast: dict = {}     # (dtype char, op, algorithm) -> (MPI datatype, MPI op, size limit)
        self.tuning = self.mpi.bcast(tuning.load() if self.rank == 0 else None, root=0)

    # ------------------------------------------------------------------ plumbing
    def phase(self, label: str):
        """``with comm.phase("forward"): ...`` labels the bytes sent inside it."""
        return self.traffic.phase(label)

    def free(self) -> None:
        if self._node_comms is not None:
            self._node_comms.free()
        for c in (self._meta, self._algo, self.mpi):
            if c != MPI.COMM_NULL:
                c.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def split(self, color: int, key: int = 0) -> "Communicator":
        """A new Communicator over the ranks that pass the same ``color``."""
        sub = self.mpi.Split(color, key)
        try:
            return Communicator(sub, validate=self.validate, timeout=self.watchdog.timeout)
        finally:
            sub.Free()

    def _begin(self, name: str) -> tuple[int, str]:
        self._seq += 1
        self.traffic.count_call(name)
        return self._seq, f"{name} #{self._seq}"

    def _direct(self, nonblocking: bool) -> bool:
        return not nonblocking and self.watchdog.timeout is None

    def _run(self, steps: Steps, what: str, nonblocking: bool):
        if nonblocking:
            return Handle(steps, self.watchdog, what)
        return drive(steps, self.watchdog, what)

    def _prepare(self, what: str, sig, same: tuple[str, ...], fn):
        """Run local argument checks; with validation on, compare across ranks first
        (``sig()`` builds this rank's signature only then)."""
        err, res = None, None
        try:
            res = fn()
        except _LOCAL_ERRORS as e:
            err = e
        if self.validate:
            self._exchange_check(what, sig(), same, err)
        if err is not None:
            raise err
        return res

    def _exchange_check(self, what: str, sig: dict, same: tuple[str, ...], err) -> None:
        sig = {**sig, "seq": self._seq}
        validate.check(validate.exchange(self._meta, self.watchdog, what, sig, err), same)

    @staticmethod
    def _sig(name: str, x: Any, **extra) -> dict:
        return {"collective": name, "dtype": str(getattr(x, "dtype", type(x).__name__)),
                "shape": tuple(getattr(x, "shape", ())), **extra}

    def _array(self, x: Any):
        """Contiguous array of a supported dtype (lists and scalars become NumPy arrays)."""
        if not backend.is_device(x) and not isinstance(x, np.ndarray):
            x = np.asarray(x)
        check_dtype(x.dtype)
        return backend.as_contiguous(x)

    def _stage(self, x) -> bool:
        """Whether this (device) array must travel through host memory."""
        if not backend.is_device(x):
            return False
        backend.synchronize(x)
        if self._staging is None:
            self._staging = not backend.cuda_aware_mpi()
        return self._staging

    def _to_host(self, a):
        return backend.device_ops(a).to_host(a)

    def _staged(self, steps: Steps, like, out) -> Steps:
        """Run host ``steps``, then copy the result to ``out`` (or a new device array)."""
        res = yield from steps
        if res is None:
            return None
        dev = out if out is not None and out.shape == res.shape else backend.empty(res.shape, res.dtype, like)
        backend.device_ops(like).from_host(dev, res)
        return dev

    @staticmethod
    def _finish(res, out):
        """Copy into a caller's ``out`` when the algorithm worked elsewhere (non-contiguous out)."""
        if out is None or res is None or res is out:
            return res
        out[...] = res.reshape(out.shape)
        return out

    def _record_mpi(self, name: str, nbytes: int) -> None:
        if nbytes:
            self.traffic.record(nbytes, name, "mpi")

    def _on_send(self, name: str):
        topo, traffic = self.topology, self.traffic

        def on_send(nbytes: int, peer: int) -> None:
            traffic.record(nbytes, name, topo.peer_class(peer))
        return on_send

    def _out_buffer(self, out, a, shape):
        """The contiguous buffer results land in: ``out`` itself when possible."""
        if out is None:
            return backend.empty(shape, a.dtype, a)
        if tuple(out.shape) != tuple(shape) or out.dtype != a.dtype:
            raise ValueError(f"out has shape {tuple(out.shape)} dtype {out.dtype}; "
                             f"expected {tuple(shape)} {a.dtype}")
        if backend.is_device(out) or out.flags.c_contiguous:
            return out
        return np.empty(shape, a.dtype)

    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, x, op: "ReduceOp | str" = "sum", *, out=None, algorithm: str = "auto",
                  nonblocking: bool = False):
        """Element-wise reduction over all ranks; every rank gets the (bit-identical) result."""
        fast = self._fast.get((x.dtype.char, op, algorithm)) if type(x) is np.ndarray else None
        if fast is not None and x.nbytes < fast[2] and not nonblocking and x.flags.c_contiguous and (
                out is None or out is x or (type(out) is np.ndarray and out.flags.c_contiguous
                                            and out.shape == x.shape and out.dtype == x.dtype)):
            # Hot path for small host messages that go to MPI's own call: the slow path below
            # has already checked this (dtype, op, algorithm) once and cached the MPI handles.
            self._seq += 1
            self.traffic.count_call("allreduce")
            dst = np.empty_like(x) if out is None else out
            self.mpi.Allreduce(MPI.IN_PLACE if dst is x else [x, fast[0]], [dst, fast[0]], op=fast[1])
            self.traffic.record(x.nbytes, "allreduce", "mpi")
            return dst
        seq, what = self._begin("allreduce")
        sig = lambda: self._sig("allreduce", x, op=str(op), algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            a = self._array(x)
            check_reducible(o, a.dtype)
            alg = select.choose("allreduce", algorithm, a.nbytes, self.size, o, self.topology, self.tuning)
            return o, a, alg
        o, a, alg = self._prepare(what, sig, ("collective", "dtype", "shape", "op", "algorithm"), prep)
        what = f"{what} ({alg}, {a.nbytes} bytes)"
        self._remember_fast(x, op, algorithm, o, a, alg)
        inplace = out is x
        if self._stage(a):
            h = self._to_host(a)
            steps = self._staged(self._allreduce(h, h, o, alg, seq, nonblocking), x, x if inplace else out)
            return self._run(steps, what, nonblocking)
        target = a if inplace and a is x else self._out_buffer(None if inplace else out, a, a.shape)
        steps = self._allreduce(a, target, o, alg, seq, nonblocking)
        res = self._run(steps, what, nonblocking)
        if nonblocking:
            return res
        return self._finish(res, x if inplace else out)

    def _allreduce(self, a, dst, op: ReduceOp, alg: str, seq: int, nonblocking: bool) -> Steps:
        if self.size == 1:
            if dst is not a:
                dst[...] = a
            return dst
        dt = mpi_datatype(a.dtype)
        if alg == "mpi":
            self._record_mpi("allreduce", a.nbytes)
            return (yield from native.allreduce(self.mpi, a, dst, dt, mpi_op(op, a.dtype), self._direct(nonblocking)))
        fn = ufunc(op, backend.xp_of(a))
        reduce = lambda p, q, r: fn(p, q, out=r)  # noqa: E731
        kw = dict(dtype=dt, itemsize=a.dtype.itemsize, seg=self._segment(a.dtype), tag=seq & 0x7FFF,
                  on_send=self._on_send("allreduce"))
        with self._workspace.borrow(self._slots(a.size, a.dtype), a.dtype, a) as tmp:
            if alg == "ring":
                yield from ring.all_reduce(self._algo, a.reshape(-1), dst.reshape(-1), reduce, tmp, **kw)
            else:   # two-level; uneven nodes have no common shard layout: leader variant
                sharded = alg == "hierarchical" and self.topology.uniform
                yield from hierarchical.all_reduce(self.node_comms, a.reshape(-1), dst.reshape(-1), reduce,
                                                   tmp, sharded=sharded, **kw)
        return dst

    @property
    def node_comms(self) -> hierarchical.NodeComms:
        """Intra-node, inter-node and leader communicators (created on first use: collective)."""
        if self._node_comms is None:
            self._node_comms = hierarchical.NodeComms(self._algo, self.topology)
        return self._node_comms

    def _remember_fast(self, x, op, algorithm, o: ReduceOp, a, alg: str) -> None:
        """Cache MPI handles for (dtype, op, algorithm) when small host calls go to MPI."""
        if (alg != "mpi" or self.validate or self.watchdog.timeout is not None or self.size == 1
                or type(x) is not np.ndarray or not isinstance(op, (str, ReduceOp))):
            return
        limit = 1 << 62 if algorithm == "mpi" else select.crossover("allreduce", self.size, self.tuning)
        self._fast[(a.dtype.char, op, algorithm)] = (mpi_datatype(a.dtype), mpi_op(o, a.dtype), limit)

    def _segment(self, dtype) -> int:
        return max(1, self.segment_bytes // np.dtype(dtype).itemsize)

    def _slots(self, chunk: int, dtype) -> int:
        """Elements of receive scratch for the ring: RING_DEPTH segments, at most ``chunk``
        (pass an upper bound of every chunk the algorithm will receive)."""
        return max(1, min(chunk, RING_DEPTH * self._segment(dtype)))

    # ------------------------------------------------------------------ rooted reduce / bcast
    def reduce(self, x, op: "ReduceOp | str" = "sum", root: int = 0, *, out=None,
               algorithm: str = "auto", nonblocking: bool = False):
        """Reduction to ``root``; returns the result there and ``None`` elsewhere."""
        seq, what = self._begin("reduce")
        sig = lambda: self._sig("reduce", x, op=str(op), root=root, algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            self._check_root(root)
            a = self._array(x)
            check_reducible(o, a.dtype)
            select.choose("reduce", algorithm, a.nbytes, self.size, o, self.topology, self.tuning)
            return o, a
        o, a = self._prepare(what, sig, ("collective", "dtype", "shape", "op", "root", "algorithm"), prep)
        staged = self._stage(a)
        src = self._to_host(a) if staged else a
        is_root = self.rank == root
        dst = None
        if is_root:
            dst = src if (out is x and src is x) else (np.empty_like(src) if staged else self._out_buffer(out, a, a.shape))
        if self.size == 1:
            if dst is not src:
                dst[...] = src
            steps = _value(dst)
        else:
            self._record_mpi("reduce", 0 if is_root else a.nbytes)
            steps = native.reduce(self.mpi, src, dst, mpi_datatype(a.dtype), mpi_op(o, a.dtype), root,
                                  self._direct(nonblocking))
        if staged:
            steps = self._staged(steps, x, out)
        res = self._run(steps, what, nonblocking)
        return res if nonblocking or staged else self._finish(res, out)

    def broadcast(self, x, root: int = 0, *, nonblocking: bool = False):
        """Root's ``x`` to every rank. Non-roots pass a buffer of the same shape and dtype,
        which is filled in place and returned."""
        seq, what = self._begin("broadcast")
        sig = lambda: self._sig("broadcast", x, root=root)  # noqa: E731

        def prep():
            self._check_root(root)
            return self._array(x)
        a = self._prepare(what, sig, ("collective", "dtype", "shape", "root"), prep)
        staged = self._stage(a)
        buf = self._to_host(a) if staged else a
        if self.size == 1:
            steps = _value(buf)
        else:
            self._record_mpi("broadcast", buf.nbytes if self.rank == root else 0)
            steps = native.bcast(self.mpi, buf, mpi_datatype(a.dtype), root, self._direct(nonblocking))
        target = x if (backend.is_device(x) or isinstance(x, np.ndarray)) else None
        if staged:
            steps = self._staged(steps, x, target)
        res = self._run(steps, what, nonblocking)
        return res if nonblocking or staged else self._finish(res, target)

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root {root!r} is not a rank of this communicator (size {self.size})")

    # ------------------------------------------------------------------ gather family
    def _rows(self, a) -> tuple[int, tuple, int]:
        """(rows, trailing shape, elements per row) for axis-0 concatenation."""
        shape = tuple(a.shape) or (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        return shape[0], shape[1:], row

    def _row_counts(self, rows: int, root: int | None) -> list[int] | None:
        mine = np.array([rows], np.int64)
        every = np.empty(self.size, np.int64)
        if root is None:
            self.watchdog.wait([self.mpi.Iallgather(mine, every)], "allgather of row counts")
            return every.tolist()
        self.watchdog.wait([self.mpi.Igather(mine, every if self.rank == root else None, root=root)],
                           "gather of row counts")
        return every.tolist() if self.rank == root else None

    def gather(self, x, root: int = 0, *, nonblocking: bool = False):
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (``None`` elsewhere)."""
        seq, what = self._begin("gather")

        def prep():
            self._check_root(root)
            return self._array(x)
        sig = lambda: self._sig("gather", x, root=root, trailing=tuple(getattr(x, "shape", ()))[1:])  # noqa: E731
        a = self._prepare(what, sig, ("collective", "dtype", "trailing", "root"), prep)
        staged = self._stage(a)
        src = self._to_host(a) if staged else a
        rows, trailing, row = self._rows(src)
        counts = self._row_counts(rows, root)
        dst = None
        if self.rank == root:
            dst = (np.empty if staged else lambda s, d: backend.empty(s, d, a))((sum(counts),) + trailing, a.dtype)
        self._record_mpi("gather", 0 if self.rank == root else src.nbytes)
        elems = None if counts is None else [c * row for c in counts]
        steps = native.gatherv(self.mpi, src, dst, elems, mpi_datatype(a.dtype), root, self._direct(nonblocking))
        return self._run(self._staged(steps, x, None) if staged else steps, what, nonblocking)

    def allgather(self, x, *, out=None, algorithm: str = "auto", nonblocking: bool = False):
        """Concatenate every rank's ``x`` along axis 0 on every rank."""
        seq, what = self._begin("allgather")
        sig = lambda: self._sig("allgather", x, algorithm=algorithm, trailing=tuple(getattr(x, "shape", ()))[1:])  # noqa: E731

        def prep():
            a = self._array(x)
            return a, select.choose("allgather", algorithm, a.nbytes * self.size, self.size, None, self.topology, self.tuning)
        a, alg = self._prepare(what, sig, ("collective", "dtype", "trailing", "algorithm"), prep)
        staged = self._stage(a)
        src = self._to_host(a) if staged else a
        rows, trailing, row = self._rows(src)
        counts = self._row_counts(rows, None)
        shape = (sum(counts),) + trailing
        dst = np.empty(shape, a.dtype) if staged else self._out_buffer(out, a, shape)
        elems = [c * row for c in counts]
        dt = mpi_datatype(a.dtype)
        if alg == "ring" and self.size > 1:
            steps = self._ring_allgather(src, dst, elems, dt, seq)
        else:
            self._record_mpi("allgather", src.nbytes if self.size > 1 else 0)
            steps = native.allgatherv(self.mpi, src, dst, elems, dt, self._direct(nonblocking))
        if staged:
            steps = self._staged(steps, x, out)
        res = self._run(steps, f"{what} ({alg})", nonblocking)
        return res if nonblocking or staged else self._finish(res, out)

    def _ring_allgather(self, src, dst, elems, dt, seq) -> Steps:
        flat = dst.reshape(-1)
        lo = sum(elems[:self.rank])
        flat[lo:lo + elems[self.rank]] = src.reshape(-1)
        yield from ring.all_gather(self._algo, flat, elems, dtype=dt, itemsize=src.dtype.itemsize,
                                   seg=self._segment(src.dtype), tag=seq & 0x7FFF,
                                   on_send=self._on_send("allgather"))
        return dst

    def scatter(self, x, root: int = 0, *, nonblocking: bool = False):
        """Split root's ``x`` along axis 0 like ``numpy.array_split``; rank r gets piece r.
        Non-roots may pass ``None``."""
        seq, what = self._begin("scatter")
        sig = lambda: {"collective": "scatter", "root": root}  # noqa: E731

        def prep():
            self._check_root(root)
            if self.rank == root:
                a = self._array(x)
                if a.ndim == 0:
                    raise ValueError("scatter needs an array with at least one dimension")
                return a
            return None
        a = self._prepare(what, sig, ("collective", "root"), prep)
        staged = a is not None and self._stage(a)
        src = self._to_host(a) if staged else a
        meta = (tuple(src.shape), src.dtype.str, staged) if self.rank == root else None
        shape, dtype, staged_root = self.mpi.bcast(meta, root=root)
        dtype = np.dtype(dtype)
        counts = ring.chunk_counts(shape[0], self.size)
        row = int(np.prod(shape[1:], dtype=np.int64))
        like = x if (self.rank == root and not staged) else None
        dst = backend.empty((counts[self.rank],) + tuple(shape[1:]), dtype, like) if like is not None \
            else np.empty((counts[self.rank],) + tuple(shape[1:]), dtype)
        if self.rank == root:
            self._record_mpi("scatter", src.nbytes - counts[root] * row * dtype.itemsize)
        steps = native.scatterv(self.mpi, src, dst, [c * row for c in counts], mpi_datatype(dtype), root,
                                self._direct(nonblocking))
        if staged:
            steps = self._staged(steps, x, None)
        return self._run(steps, what, nonblocking)

    def reduce_scatter(self, x, op: "ReduceOp | str" = "sum", *, algorithm: str = "auto",
                       nonblocking: bool = False):
        """Reduce ``x`` over ranks, then split axis 0 like ``numpy.array_split``;
        rank r gets piece r."""
        seq, what = self._begin("reduce_scatter")
        sig = lambda: self._sig("reduce_scatter", x, op=str(op), algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            a = self._array(x)
            if a.ndim == 0:
                raise ValueError("reduce_scatter needs an array with at least one dimension")
            check_reducible(o, a.dtype)
            return o, a, select.choose("reduce_scatter", algorithm, a.nbytes, self.size, o, self.topology, self.tuning)
        o, a, alg = self._prepare(what, sig, ("collective", "dtype", "shape", "op", "algorithm"), prep)
        staged = self._stage(a)
        src = self._to_host(a) if staged else a
        rows = ring.chunk_counts(src.shape[0], self.size)
        row = int(np.prod(src.shape[1:], dtype=np.int64))
        elems = [c * row for c in rows]
        shape = (rows[self.rank],) + tuple(src.shape[1:])
        dst = np.empty(shape, a.dtype) if staged else backend.empty(shape, a.dtype, a)
        dt = mpi_datatype(a.dtype)
        if self.size == 1:
            dst[...] = src
            steps = _value(dst)
        elif alg == "ring":
            steps = self._ring_reduce_scatter(src, dst, elems, o, dt, seq)
        else:
            self._record_mpi("reduce_scatter", src.nbytes - elems[self.rank] * a.dtype.itemsize)
            steps = native.reduce_scatter(self.mpi, src, dst, elems, dt, mpi_op(o, a.dtype),
                                          self._direct(nonblocking))
        if staged:
            steps = self._staged(steps, x, None)
        return self._run(steps, f"{what} ({alg})", nonblocking)

    def _ring_reduce_scatter(self, src, dst, elems, op, dt, seq) -> Steps:
        fn = ufunc(op, backend.xp_of(src))
        lo = sum(elems[:self.rank])
        with self._workspace.borrow(src.size, src.dtype, src) as full, \
                self._workspace.borrow(self._slots(max(elems), src.dtype), src.dtype, src) as tmp:
            yield from ring.reduce_scatter(
                self._algo, src.reshape(-1), full, elems, lambda p, q, r: fn(p, q, out=r), tmp,
                dtype=dt, itemsize=src.dtype.itemsize, seg=self._segment(src.dtype), tag=seq & 0x7FFF,
                on_send=self._on_send("reduce_scatter"))
            dst.reshape(-1)[...] = full[lo:lo + elems[self.rank]]
        return dst

    def alltoall(self, x, *, nonblocking: bool = False):
        """Split axis 0 into ``size`` equal blocks; block j goes to rank j, and the
        result stacks the blocks received from ranks 0..size-1."""
        seq, what = self._begin("alltoall")
        sig = lambda: self._sig("alltoall", x)  # noqa: E731

        def prep():
            a = self._array(x)
            if a.ndim == 0 or a.shape[0] % self.size:
                raise ValueError(f"alltoall needs axis 0 divisible by the communicator size {self.size}; "
                                 f"got shape {tuple(a.shape)}")
            return a
        a = self._prepare(what, sig, ("collective", "dtype", "shape"), prep)
        staged = self._stage(a)
        src = self._to_host(a) if staged else a
        dst = np.empty_like(src) if staged else backend.empty(src.shape, src.dtype, a)
        self._record_mpi("alltoall", src.nbytes - src.nbytes // self.size)
        steps = native.alltoall(self.mpi, src, dst, mpi_datatype(a.dtype), self._direct(nonblocking))
        if staged:
            steps = self._staged(steps, x, None)
        return self._run(steps, what, nonblocking)

    def barrier(self, *, nonblocking: bool = False):
        seq, what = self._begin("barrier")
        if self.validate:
            self._exchange_check(what, {"collective": "barrier"}, ("collective",), None)
        return self._run(native.barrier(self.mpi, self._direct(nonblocking)), what, nonblocking)

    # ------------------------------------------------------------------ point to point
    def send(self, x, dest: int, tag: int = 0) -> None:
        a = self._array(x)
        if self._stage(a):
            a = self._to_host(a)
        self.traffic.record(a.nbytes, "send", self.topology.peer_class(dest))
        self.mpi.Send([a, mpi_datatype(a.dtype)], dest=dest, tag=tag)

    def recv(self, source: int = MPI.ANY_SOURCE, *, out=None, shape=None, dtype=None,
             tag: int = MPI.ANY_TAG):
        """Receive into ``out``, or into a new array of ``shape``/``dtype``; with only
        ``dtype`` the message length decides (a 1-D array)."""
        if out is None:
            if dtype is None:
                raise TypeError("recv needs out=, or dtype= (and optionally shape=)")
            dtype = np.dtype(dtype)
            if shape is None:
                status = MPI.Status()
                self.mpi.Probe(source, tag, status)
                shape = (status.Get_count(mpi_datatype(dtype)),)
                source, tag = status.Get_source(), status.Get_tag()
            out = np.empty(shape, dtype)
        if backend.is_device(out) and self._stage(out):
            host = np.empty(out.shape, out.dtype)
            self.mpi.Recv([host, mpi_datatype(out.dtype)], source=source, tag=tag)
            backend.device_ops(out).from_host(out, host)
            return out
        buf = out if backend.is_device(out) or out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        self.mpi.Recv([buf, mpi_datatype(out.dtype)], source=source, tag=tag)
        return self._finish(buf, out)

    def sendrecv(self, x, dest: int, source: int | None = None, *, out=None, sendtag: int = 0,
                 recvtag: int = MPI.ANY_TAG):
        """Send ``x`` to ``dest`` while receiving a same-shaped array from ``source``."""
        a = self._array(x)
        source = dest if source is None else source
        if self._stage(a):
            h = self._to_host(a)
            r = np.empty_like(h)
            self.traffic.record(h.nbytes, "sendrecv", self.topology.peer_class(dest))
            dt = mpi_datatype(h.dtype)
            self.mpi.Sendrecv([h, dt], dest, sendtag, [r, dt], source, recvtag)
            dev = out if out is not None else backend.empty(r.shape, r.dtype, x)
            backend.device_ops(x).from_host(dev, r)
            return dev
        buf = self._out_buffer(out, a, a.shape)
        self.traffic.record(a.nbytes, "sendrecv", self.topology.peer_class(dest))
        dt = mpi_datatype(a.dtype)
        self.mpi.Sendrecv([a, dt], dest, sendtag, [buf, dt], source, recvtag)
        return self._finish(buf, out)


def _value(v) -> Steps:
    """Steps that communicate nothing and return ``v``."""
    return v
    yield  # pragma: no cover  (makes this a generator)
