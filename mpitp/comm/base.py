"""What every collective of :class:`mpitp.Communicator` stands on: the duplicated MPI
communicators, validation, the watchdog, host staging of device arrays, counters."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import backend, settings
from ..errors import MpitpError
from . import timeline, transport, validate
from .algorithms import hierarchical, oneshot, ring, tuning
from .handle import Handle, Steps, Watchdog, drive
from .mpi_types import check_dtype, mpi_datatype
from .topology import Topology
from .traffic import Traffic
from .transport import cma, shm
from .workspace import Workspace

_LOCAL_ERRORS = (MpitpError, ValueError, TypeError)


class CommunicatorBase:
    """Setup and the helpers every collective uses (see :class:`mpitp.Communicator`)."""

    def __init__(
        self,
        comm: MPI.Comm | CommunicatorBase | None = None,
        *,
        validate: bool | None = None,
        timeout: float | None = None,
        ranks_per_node: int | None = None,
        topology: Topology | None = None,
    ):
        base = comm.mpi if isinstance(comm, CommunicatorBase) else (comm or MPI.COMM_WORLD)
        self.mpi: MPI.Comm = base.Dup()  # user-visible traffic (collectives, p2p)
        self._algo: MPI.Comm = self.mpi.Dup()  # hand-written algorithms' messages
        self._meta: MPI.Comm = self.mpi.Dup()  # validation exchange
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self._fast: dict = {}  # (dtype, op, algorithm) -> reductions.FastAllreduce
        env = settings.current()
        self.validate = env.validate if validate is None else bool(validate)
        self.watchdog = Watchdog.from_env(timeout, MPI.COMM_WORLD.rank)
        self.topology = topology if topology is not None else Topology.detect(self.mpi, ranks_per_node)
        self.traffic = Traffic()
        self.segment_bytes = env.ring_segment
        self.ring_depth = env.ring_depth  # receive segments in flight
        self._staging: bool | None = None  # decided on first device array (asks MPI once)
        self._seq = 0
        self._workspace = Workspace()
        self._node_comms: hierarchical.NodeComms | None = None
        # the ring's shared-memory transport (mpitp.comm.transport.shm): opened on first use, when
        # every rank is on one node; ``shm = False`` (or MPITP_SHM=0) keeps MPI's transport
        self.shm = shm.enabled()
        self.shm_max_bytes = shm.max_bytes()  # the largest buffer it takes (see shm.py)
        # larger buffers: single-copy reads from the neighbour's memory (mpitp.comm.transport.cma);
        # ``cma = False`` (or MPITP_CMA=0) gives them MPI's transport
        self.cma = cma.enabled()
        self.cma_segment_bytes = cma.segment_bytes()
        self._links = transport.Links(self.watchdog, self._meta)  # channels opened so far
        # small all-reduces on one node: the compiled one-shot (mpitp.comm.algorithms.oneshot),
        # opened on the first call that may use it (False where it cannot open);
        # MPITP_ONESHOT_MAX=0 (or MPITP_SHM=0) leaves them to MPI
        self.oneshot_max = env.oneshot_max if self.shm else 0
        self._oneshot: Any = None  # a OneShot, or False
        self._gathershot: Any = None  # the one-shot all-gather's (allgather_columns), or False
        self._timeline = timeline.start(self._meta, env.timeline)  # MPITP_TIMELINE; None when off
        self.tuning = self.mpi.bcast(tuning.load() if self.rank == 0 else None, root=0)

    @property
    def validate(self) -> bool:
        """Compare every collective's arguments across ranks first (MPITP_VALIDATE=1)."""
        return self._validate

    @validate.setter
    def validate(self, on: bool) -> None:
        self._validate = bool(on)
        self._fast.clear()  # the fast path skips validation: drop it

    # ------------------------------------------------------------------ plumbing
    def phase(self, label: str):
        """``with comm.phase("forward"): ...`` labels the bytes sent inside it."""
        return self.traffic.phase(label)

    def _open_window(self, window, capacity: int, what: str, gather: bool = False):
        """``window`` (a one-shot window, or False where none can be), opened on the first
        call that may use it: a blocking collective, so every rank is first made sure to be
        in this call. The all-reduce's and the logits' all-gather's each come through here."""
        if window is None:
            self.watchdog.wait([self._meta.Ibarrier()], f"call #{self._seq} (opening the one-shot {what})")
            window = oneshot.open_oneshot(self._algo, capacity, self.watchdog, gather) or False
        return window

    def free(self) -> None:
        self._fast.clear()
        if self._node_comms is not None:
            self._node_comms.free()
        self._links.free()
        if self._oneshot:
            self._oneshot.free()
        if self._gathershot:
            self._gathershot.free()
        for c in (self._meta, self._algo, self.mpi):
            if c != MPI.COMM_NULL:
                c.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def split(self, color: int, key: int = 0):
        """A new Communicator over the ranks that pass the same ``color`` (``None``: this
        rank joins none and gets ``None``), ordered by ``key``, then by rank here. It keeps
        this communicator's node map (real or simulated nodes), so its traffic counters
        still tell intra- from inter-node bytes. Collective over this communicator."""
        self.watchdog.wait([self.mpi.Ibarrier()], "split (a collective: every rank calls it)")  # MPI has no Isplit
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return self._adopt(sub)

    def group(self, ranks):
        """A new Communicator over ``ranks`` (ranks of this one, in that order); ranks not
        listed get ``None``. Collective over this communicator: every rank calls it with
        the same list (torch.distributed.new_group's contract)."""
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks):
            raise ValueError(f"group ranks {ranks}: distinct ranks of this communicator (size {self.size})")
        g = self.mpi.Get_group()
        try:
            sub_group = g.Incl(ranks)
            sub = self.mpi.Create(sub_group)
            sub_group.Free()
        finally:
            g.Free()
        return self._adopt(sub)

    def mesh(self, shape, names):
        """The ranks as a grid, one sub-communicator per dimension, the last innermost
        (kept inside a node where the node has room): ``comm.mesh((2, 2), ("dp", "tp"))``.
        See :mod:`mpitp.comm.mesh`. Collective."""
        from .mesh import build

        return build(self, tuple(shape), tuple(names))

    def _adopt(self, sub: MPI.Comm):
        """Wrap a new MPI sub-communicator (or COMM_NULL) with this one's settings and node map."""
        if sub == MPI.COMM_NULL:
            return None
        try:
            parent_ranks = sub.allgather(self.rank)
            nodes = [self.topology.node_of[r] for r in parent_ranks]
            index = {n: i for i, n in enumerate(sorted(set(nodes)))}
            topo = Topology(sub.rank, tuple(index[n] for n in nodes), self.topology.simulated)
            return type(self)(sub, validate=self.validate, timeout=self.watchdog.timeout, topology=topo)
        finally:
            sub.Free()

    def _begin(self, name: str) -> tuple[int, str]:
        self._seq += 1
        self.traffic.count_call(name)
        return self._seq, f"{name} #{self._seq}"

    def _call_blocking(self, nonblocking: bool) -> bool:
        return not nonblocking and self.watchdog.timeout is None

    def _run(self, steps: Steps, label: str, nonblocking: bool, algorithm: str = "mpi", nbytes: int = 0):
        if self._timeline is not None:
            steps = timeline.traced(steps, self._timeline, label.split(" #")[0], self, algorithm, nbytes)
        if nonblocking:
            return Handle(steps, self.watchdog, label)
        return drive(steps, self.watchdog, label)

    def _prepare(self, label: str, sig, same: tuple[str, ...], fn):
        """Run local argument checks; with validation on, compare across ranks first
        (``sig()`` builds this rank's signature only then)."""
        err, res = None, None
        try:
            res = fn()
        except _LOCAL_ERRORS as e:
            err = e
        if self.validate:
            self._exchange_check(label, sig(), same, err)
        if err is not None:
            raise err
        return res

    def _exchange_check(self, label: str, sig: dict, same: tuple[str, ...], err) -> None:
        sig = {**sig, "seq": self._seq}
        validate.check(validate.exchange(self._meta, self.watchdog, label, sig, err), same)

    @staticmethod
    def _sig(name: str, x: Any, **extra) -> dict:
        return {
            "collective": name,
            "dtype": str(getattr(x, "dtype", type(x).__name__)),
            "shape": tuple(getattr(x, "shape", ())),
            **extra,
        }

    def _array(self, x: Any):
        """Contiguous array of a supported dtype (lists and scalars become NumPy arrays)."""
        if not backend.is_device(x) and not isinstance(x, np.ndarray):
            x = np.asarray(x)
        check_dtype(x.dtype)
        return backend.as_contiguous(x)

    def _via_host(self, x) -> bool:
        """Whether this (device) array must travel through host memory."""
        if not backend.is_device(x):
            return False
        backend.synchronize(x)
        if self._staging is None:
            self._staging = not backend.cuda_aware_mpi()
        return self._staging

    def _to_host(self, a):
        return backend.device_ops(a).to_host(a)

    def _back_to_device(self, steps: Steps, like, out) -> Steps:
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
            raise ValueError(f"out has shape {tuple(out.shape)} dtype {out.dtype}; expected {tuple(shape)} {a.dtype}")
        if backend.is_device(out) or out.flags.c_contiguous:
            return out
        return np.empty(shape, a.dtype)

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root {root!r} is not a rank of this communicator (size {self.size})")

    def _segment(self, dtype) -> int:
        return max(1, self.segment_bytes // np.dtype(dtype).itemsize)

    def _wire(self, dtype, seq: int, name: str) -> ring.Wire:
        """How call ``seq`` (collective ``name``) sends ``dtype`` elements around a ring."""
        return ring.Wire(
            dtype=mpi_datatype(dtype),
            itemsize=np.dtype(dtype).itemsize,
            seg=self._segment(dtype),
            tag=seq & 0x7FFF,
            on_send=self._on_send(name),
        )

    def _ring_transport(self, a, nbytes: int, nonblocking: bool, label: str, scope: str = "flat"):
        """The MPI communicator or the channel a ring over ``scope`` (``"flat"``: all ranks,
        ``"intra"``: this node's) runs over (:mod:`mpitp.comm.transport`). Collective."""
        comm = self._algo if scope == "flat" else self.node_comms.intra
        return self._links.pick(comm, a, nbytes, nonblocking, label, scope, self)

    def _step_marks(self, n: int):
        """For the timeline: a ring's ``on_step`` that records each of its 2(n-1) steps."""
        tl = self._timeline
        if tl is None:
            return None
        last = [tl.now()]

        def on_step(s: int) -> None:
            now = tl.now()
            part = "reduce-scatter" if s < n - 1 else "all-gather"
            tl.span(f"ring step {s} ({part})", "ring", last[0], now, tid=1, step=s)
            last[0] = now

        return on_step

    def _slots(self, chunk: int, dtype) -> int:
        """Elements of receive scratch for the ring: ``ring_depth`` segments, at most ``chunk``
        (pass an upper bound of every chunk the algorithm will receive)."""
        return max(1, min(chunk, self.ring_depth * self._segment(dtype)))

    @property
    def node_comms(self) -> hierarchical.NodeComms:
        """Intra-node, inter-node and leader communicators (created on first use: collective)."""
        if self._node_comms is None:
            # blocking splits: first make sure every rank is here, under the watchdog
            self.watchdog.wait([self._meta.Ibarrier()], f"call #{self._seq} (setting up the node communicators)")
            self._node_comms = hierarchical.NodeComms(self._algo, self.topology)
        return self._node_comms


def value_steps(v) -> Steps:
    """Steps that communicate nothing and return ``v``."""
    return v
    yield  # pragma: no cover  (makes this a generator)
