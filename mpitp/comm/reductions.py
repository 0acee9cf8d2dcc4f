"""All-reduce, reduce, broadcast and reduce-scatter: MPI's own call, the ring, or the
two-level algorithm, chosen per call (:mod:`mpitp.comm.algorithms.select`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import backend, split
from ..errors import UnsupportedOperation
from .algorithms import hierarchical, mpi_collectives, oneshot, ring, select
from .algorithms.select import NEVER
from .base import CommunicatorBase, value_steps
from .handle import Steps
from .mpi_types import ReduceOp, average, check_reducible, inferred, mpi_datatype, mpi_op, ufunc


@dataclass(slots=True)
class FastAllreduce:
    """What the small all-reduce reuses for one (dtype, op, algorithm): valid while the
    traffic counters' ``epoch`` is unchanged and validation and the watchdog are off."""

    datatype: MPI.Datatype
    mpi_op: MPI.Op
    max_bytes: int  # messages from this size on go to the ring: not this path
    plain: bool  # mpi4py infers ``datatype`` from the buffer itself
    calls: list  # the traffic cells it bumps: [calls]
    sent: list  # [bytes, messages]
    epoch: int
    oneshot: Any = None  # OneShot.allreduce, for messages of at most oneshot_max bytes
    oneshot_max: int = -1
    op_name: str = "sum"
    intra: list = field(default_factory=lambda: [0, 0])  # the one-shot's traffic cell


class Reductions(CommunicatorBase):
    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, x, op: ReduceOp | str = "sum", *, out=None, algorithm: str = "auto", nonblocking: bool = False):
        """Element-wise reduction over all ranks; every rank gets the (bit-identical) result."""
        if type(x) is np.ndarray and not nonblocking:
            fast = self._fast.get((x.dtype, op, algorithm))
            if (
                fast is not None
                and x.nbytes < fast.max_bytes
                and fast.epoch == self.traffic.epoch
                and (
                    x.flags.c_contiguous
                    and (
                        out is None
                        or out is x
                        or (
                            type(out) is np.ndarray
                            and out.flags.c_contiguous
                            and out.shape == x.shape
                            and out.dtype == x.dtype
                        )
                    )
                )
            ):
                # Fast path: a small host message that goes to MPI's own call, for a
                # (dtype, op, algorithm) the checked path has seen once; its MPI handles and
                # traffic counters are cached (inline: a method call would cost 10% here).
                # The smallest go to the one-shot all-reduce where it is open.
                dst = np.empty_like(x) if out is None else out
                if x.nbytes <= fast.oneshot_max:
                    fast.oneshot(x, dst, fast.op_name)
                    fast.calls[0] += 1
                    fast.intra[0] += x.nbytes * (self.size - 1)
                    fast.intra[1] += self.size - 1
                    return dst
                if dst is x:
                    self.mpi.Allreduce(MPI.IN_PLACE, x if fast.plain else [x, fast.datatype], fast.mpi_op)
                elif fast.plain:
                    self.mpi.Allreduce(x, dst, fast.mpi_op)
                else:
                    self.mpi.Allreduce([x, fast.datatype], [dst, fast.datatype], fast.mpi_op)
                self._seq += 1
                fast.calls[0] += 1
                if x.nbytes:
                    fast.sent[0] += x.nbytes
                    fast.sent[1] += 1
                return dst
        return self._checked_allreduce(x, op, out, algorithm, nonblocking)

    def _checked_allreduce(self, x, op, out, algorithm: str, nonblocking: bool):
        """All-reduce with every check (kept out of ``allreduce``: its closures would make
        each call of the fast path above build cells)."""
        seq, label = self._begin("allreduce")
        sig = lambda: self._sig("allreduce", x, op=str(op), algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            a = self._array(x)
            check_reducible(o, a.dtype)
            shot = self._oneshot_bytes(a, o, nonblocking, algorithm)
            alg = select.choose("allreduce", algorithm, a.nbytes, self.size, o, self.topology, self.tuning, shot)
            if alg == "oneshot" and self.size > 1 and (shot == 0 or a.nbytes > shot):
                raise UnsupportedOperation(
                    f"algorithm 'oneshot' takes a blocking call on host arrays of {oneshot.DTYPE_NAMES} with "
                    f"{', '.join(oneshot.OPS)} (avg: floats), every rank on one node, at most "
                    f"MPITP_ONESHOT_MAX = {self.oneshot_max} bytes; got {a.nbytes} bytes of {a.dtype} with {o.value}"
                    + (" (ranks on several nodes)" if self._oneshot is False or self.topology.num_nodes > 1 else "")
                )
            return o, a, alg

        o, a, alg = self._prepare(label, sig, ("collective", "dtype", "shape", "op", "algorithm"), prep)
        label = f"{label} ({alg}, {a.nbytes} bytes)"
        self._remember_fast(x, op, algorithm, o, a, alg)
        inplace = out is x
        if self._via_host(a):
            h = self._to_host(a)
            steps = self._back_to_device(self._allreduce(h, h, o, alg, seq, nonblocking), x, x if inplace else out)
            return self._run(steps, label, nonblocking, alg, a.nbytes)
        target = a if inplace and a is x else self._out_buffer(None if inplace else out, a, a.shape)
        steps = self._allreduce(a, target, o, alg, seq, nonblocking)
        res = self._run(steps, label, nonblocking, alg, a.nbytes)
        if nonblocking:
            return res
        return self._finish(res, x if inplace else out)

    def _allreduce(self, a, dst, op: ReduceOp, alg: str, seq: int, nonblocking: bool) -> Steps:
        if op is ReduceOp.AVG:
            return (yield from _averaged(self._allreduce(a, dst, ReduceOp.SUM, alg, seq, nonblocking), self.size))
        if self.size == 1:
            if dst is not a:
                dst[...] = a
            return dst
        if alg == "oneshot":
            self._oneshot.label = f"allreduce #{seq} (oneshot, {a.nbytes} bytes)"
            self._oneshot.allreduce(a, dst, op.value)
            for _ in range(self.size - 1):
                self.traffic.record(a.nbytes, "allreduce", "intra")
            return dst
        dt = mpi_datatype(a.dtype)
        if alg == "mpi":
            self._record_mpi("allreduce", a.nbytes)
            return (
                yield from mpi_collectives.allreduce(
                    self.mpi, a, dst, dt, mpi_op(op, a.dtype), self._call_blocking(nonblocking)
                )
            )
        fn = ufunc(op, backend.xp_of(a))
        reduce = lambda p, q, r: fn(p, q, out=r)  # noqa: E731
        wire = self._wire(a.dtype, seq, "allreduce")
        slots = self._slots(a.size, a.dtype)
        if alg != "ring":
            slots = hierarchical.scratch_slots(slots)
        with self._workspace.borrow(slots, a.dtype, a) as tmp:
            if alg == "ring":
                link = self._ring_transport(a, a.nbytes, nonblocking, f"allreduce #{seq}")
                marks = wire.but(on_step=self._step_marks(self.size))
                yield from ring.all_reduce(link, a.reshape(-1), dst.reshape(-1), reduce, tmp, marks)
            else:  # two-level; uneven nodes have no common shard layout: leader variant
                sharded = alg == "hierarchical" and self.topology.uniform
                intra = self._ring_transport(a, a.nbytes, nonblocking, f"allreduce #{seq}", scope="intra")
                yield from hierarchical.all_reduce(
                    self.node_comms,
                    a.reshape(-1),
                    dst.reshape(-1),
                    reduce,
                    tmp,
                    wire,
                    sharded=sharded,
                    intra=intra,
                    trace=self._timeline,
                )
        return dst

    def _oneshot_bytes(self, a, o: ReduceOp, nonblocking: bool, algorithm: str) -> int:
        """Bytes this call may send through the one-shot all-reduce; 0 where it cannot. Opens
        it on the first call that may use it: collective (every rank makes the same call)."""
        if (
            self.size == 1
            or nonblocking
            or type(a) is not np.ndarray
            or self.oneshot_max == 0
            or self.topology.num_nodes > 1  # real or simulated (MPITP_RANKS_PER_NODE): counted as such
            or algorithm not in ("auto", "oneshot")
            or not oneshot.supports(a.dtype, o.base.value)
        ):
            return 0
        self._oneshot = self._open_window(self._oneshot, self.oneshot_max, "all-reduce")
        if not self._oneshot or (algorithm == "auto" and self._oneshot.oversubscribed):
            return 0  # more ranks than cores: spinning ranks would take turns; MPI's call waits better
        return self.oneshot_max

    def _remember_fast(self, x, op, algorithm, o: ReduceOp, a, alg: str) -> None:
        """Cache MPI handles for (dtype, op, algorithm) when small host calls go to MPI (or
        to the one-shot all-reduce)."""
        if (
            self._timeline is not None
            or alg not in ("mpi", "oneshot")
            or self.validate
            or self.watchdog.timeout is not None
            or o is ReduceOp.AVG
            or type(x) is not np.ndarray
            or not isinstance(op, (str, ReduceOp))
        ):
            return
        t = self.traffic
        shot = self._oneshot_bytes(a, o, False, algorithm) if self.size > 1 else 0
        if algorithm == "mpi":
            top = NEVER
        elif algorithm == "oneshot":
            top = shot + 1  # larger: the checked path, which says why not
        else:
            top = select.crossover("allreduce", self.size, self.tuning, self.topology.num_nodes)
        self._fast[(a.dtype, op, algorithm)] = FastAllreduce(
            datatype=mpi_datatype(a.dtype),
            mpi_op=mpi_op(o, a.dtype),
            max_bytes=top,
            plain=inferred(a.dtype),
            calls=t.calls_cell("allreduce"),
            sent=t.cell("allreduce", "mpi") if self.size > 1 else [0, 0],  # alone, nothing goes to others
            epoch=t.epoch,
            oneshot=self._oneshot.allreduce if shot else None,
            oneshot_max=shot if shot else -1,
            op_name=o.value,
            intra=t.cell("allreduce", "intra") if shot else [0, 0],
        )

    # ------------------------------------------------------------------ rooted reduce / bcast
    def reduce(
        self,
        x,
        op: ReduceOp | str = "sum",
        root: int = 0,
        *,
        out=None,
        algorithm: str = "auto",
        nonblocking: bool = False,
    ):
        """Reduction to ``root``; returns the result there and ``None`` elsewhere."""
        seq, label = self._begin("reduce")
        sig = lambda: self._sig("reduce", x, op=str(op), root=root, algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            self._check_root(root)
            a = self._array(x)
            check_reducible(o, a.dtype)
            select.choose("reduce", algorithm, a.nbytes, self.size, o, self.topology, self.tuning)
            return o, a

        o, a = self._prepare(label, sig, ("collective", "dtype", "shape", "op", "root", "algorithm"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        is_root = self.rank == root
        dst: Any = None
        if is_root:
            dst = (
                src
                if (out is x and src is x)
                else (np.empty_like(src) if staged else self._out_buffer(out, a, a.shape))
            )
        if self.size == 1:
            if dst is not src:
                dst[...] = src
            steps = value_steps(dst)
        else:
            self._record_mpi("reduce", 0 if is_root else a.nbytes)
            steps = mpi_collectives.reduce(
                self.mpi, src, dst, mpi_datatype(a.dtype), mpi_op(o, a.dtype), root, self._call_blocking(nonblocking)
            )
        if o is ReduceOp.AVG:
            steps = _averaged(steps, self.size)
        if staged:
            steps = self._back_to_device(steps, x, out)
        res = self._run(steps, label, nonblocking)
        return res if nonblocking or staged else self._finish(res, out)

    def broadcast(self, x, root: int = 0, *, nonblocking: bool = False):
        """Root's ``x`` to every rank. Non-roots pass a buffer of the same shape and dtype,
        which is filled in place and returned."""
        seq, label = self._begin("broadcast")
        sig = lambda: self._sig("broadcast", x, root=root)  # noqa: E731

        def prep():
            self._check_root(root)
            return self._array(x)

        a = self._prepare(label, sig, ("collective", "dtype", "shape", "root"), prep)
        staged = self._via_host(a)
        buf = self._to_host(a) if staged else a
        if self.size == 1:
            steps = value_steps(buf)
        else:
            self._record_mpi("broadcast", buf.nbytes if self.rank == root else 0)
            steps = mpi_collectives.bcast(self.mpi, buf, mpi_datatype(a.dtype), root, self._call_blocking(nonblocking))
        target = x if (backend.is_device(x) or isinstance(x, np.ndarray)) else None
        if staged:
            steps = self._back_to_device(steps, x, target)
        res = self._run(steps, label, nonblocking)
        return res if nonblocking or staged else self._finish(res, target)

    def reduce_scatter(self, x, op: ReduceOp | str = "sum", *, algorithm: str = "auto", nonblocking: bool = False):
        """Reduce ``x`` over ranks, then split axis 0 like ``numpy.array_split``;
        rank r gets piece r."""
        seq, label = self._begin("reduce_scatter")
        sig = lambda: self._sig("reduce_scatter", x, op=str(op), algorithm=algorithm)  # noqa: E731

        def prep():
            o = ReduceOp.parse(op)
            a = self._array(x)
            if a.ndim == 0:
                raise ValueError("reduce_scatter needs an array with at least one dimension")
            check_reducible(o, a.dtype)
            return o, a, select.choose("reduce_scatter", algorithm, a.nbytes, self.size, o, self.topology, self.tuning)

        o, a, alg = self._prepare(label, sig, ("collective", "dtype", "shape", "op", "algorithm"), prep)
        staged = self._via_host(a)
        src = self._to_host(a) if staged else a
        rows = split.chunk_counts(src.shape[0], self.size)
        row = int(np.prod(src.shape[1:], dtype=np.int64))
        elems = [c * row for c in rows]
        shape = (rows[self.rank],) + tuple(src.shape[1:])
        dst = np.empty(shape, a.dtype) if staged else backend.empty(shape, a.dtype, a)
        dt = mpi_datatype(a.dtype)
        if self.size == 1:
            dst[...] = src
            steps = value_steps(dst)
        elif alg == "ring":
            steps = self._ring_reduce_scatter(src, dst, elems, o, seq, nonblocking)
        else:
            self._record_mpi("reduce_scatter", src.nbytes - elems[self.rank] * a.dtype.itemsize)
            steps = mpi_collectives.reduce_scatter(
                self.mpi, src, dst, elems, dt, mpi_op(o, a.dtype), self._call_blocking(nonblocking)
            )
        if o is ReduceOp.AVG:
            steps = _averaged(steps, self.size)
        if staged:
            steps = self._back_to_device(steps, x, None)
        return self._run(steps, f"{label} ({alg})", nonblocking, alg, a.nbytes)

    def _ring_reduce_scatter(self, src, dst, elems, op, seq, nonblocking: bool) -> Steps:
        fn = ufunc(op, backend.xp_of(src))
        lo = sum(elems[: self.rank])
        with (
            self._workspace.borrow(src.size, src.dtype, src) as full,
            self._workspace.borrow(self._slots(max(elems), src.dtype), src.dtype, src) as tmp,
        ):
            link = self._ring_transport(src, src.nbytes, nonblocking, f"reduce_scatter #{seq}")
            wire = self._wire(src.dtype, seq, "reduce_scatter")
            reduce = lambda p, q, r: fn(p, q, out=r)  # noqa: E731
            yield from ring.reduce_scatter(link, src.reshape(-1), full, elems, reduce, tmp, wire)
            dst.reshape(-1)[...] = full[lo : lo + elems[self.rank]]
        return dst


def _averaged(steps: Steps, n: int) -> Steps:
    """The result of a sum's ``steps`` divided by ``n`` (None, off the root, stays None)."""
    res = yield from steps
    return res if res is None else average(res, n)
