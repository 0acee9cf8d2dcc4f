"""Single-copy transport for the ring on one node: cross-memory attach (CMA).

The shared-memory channel (:mod:`mpitp.comm.transport.shm`) copies each segment twice: into the
writer's outbox, then out of it. For buffers of many MiB those copies no longer stay in
cache, and every byte crosses memory four times. Linux's ``process_vm_readv`` (what MPI
libraries call CMA) copies straight from another process's pages, so here the writer's
slot holds only *where* the segment lies in its memory::

    rank r's slot k:   | address | bytes |            (one cache line per slot)
    rank r+1:          process_vm_readv(pid of r, address, bytes) into the target slice
                         (all-gather: the data's final place; reduce-scatter: then
                         target = own part + target, still in cache; in place calls,
                         whose target holds the own part, read into a scratch instead)

Flags and the ring's schedule are the shared-memory channel's, so results are
bit-identical to both other transports. What changes: the segment must stay untouched
until the reader has taken it. Inside the ring that holds by the data's dependencies
(a region is overwritten only by a value computed after its reader took it); at the end
of a call a rank waits until its right neighbour has taken everything it gave.

Reading another process's memory needs ptrace permission over it: same user, and under
Yama's ``ptrace_scope = 1`` the target's consent (``PR_SET_PTRACER``), which
:func:`allow_readers` gives. Opening a channel tries one read from the left neighbour on
every rank; if any fails (a seccomp filter, Yama scope 2-3, another user), no rank uses
this transport and the ring falls back to the others. ``MPITP_CMA=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
from mpi4py import MPI

from ... import settings
from . import shm

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)
_SLOT = 64  # bytes per descriptor slot: one cache line each


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Reader:
    """``process_vm_readv`` through ctypes, with its two iovecs allocated once."""

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self._readv = libc.process_vm_readv
        self._readv.restype = ctypes.c_ssize_t
        self._readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._local, self._remote = _IoVec(), _IoVec()
        self._lp, self._rp = ctypes.byref(self._local), ctypes.byref(self._remote)

    def read(self, pid: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``remote`` in process ``pid`` to ``local`` here."""
        while nbytes > 0:
            self._local.base, self._local.len = local, nbytes
            self._remote.base, self._remote.len = remote, nbytes
            got = self._readv(pid, self._lp, 1, self._rp, 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv from process {pid}: {os.strerror(err)}")
            local, remote, nbytes = local + got, remote + got, nbytes - got


def allow_readers() -> None:
    """Let other processes of this user read this one's memory where Yama restricts it
    to descendants (``ptrace_scope = 1``); elsewhere this changes nothing."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def enabled() -> bool:
    """``MPITP_CMA=0`` keeps the ring off cross-memory attach."""
    return settings.current().cma


def segment_bytes() -> int:
    """Bytes per CMA read (``MPITP_CMA_SEGMENT``, default 2 MiB; each read is a system
    call that pins the pages it copies; why 2 MiB: docs/measurements.md)."""
    return settings.current().cma_segment


def works(comm: MPI.Comm) -> tuple[bool, list[int]]:
    """Whether every rank of ``comm`` (one node) can read its left neighbour's memory,
    and every rank's pid. Collective; every rank gets the same answer."""
    allow_readers()
    probe = np.array([0x6D70697470 + comm.rank], np.int64)
    pids = comm.allgather((os.getpid(), probe.ctypes.data))
    left = (comm.rank - 1) % comm.size
    got = np.zeros(1, np.int64)
    try:
        Reader().read(pids[left][0], got.ctypes.data, pids[left][1], 8)
        ok = int(got[0]) == 0x6D70697470 + left
    except (OSError, AttributeError):
        ok = False
    ok = comm.allreduce(ok, op=MPI.LAND)  # the probe stays alive until all have read
    return ok, [p for p, _ in pids]


class DirectChannel(shm.Channel):
    """The ring's channel with descriptors in the slots and CMA reads (see the module)."""

    def __init__(self, comm: MPI.Comm, segment_bytes: int, depth: int, watchdog, pids: list[int]):
        super().__init__(comm, _SLOT, depth, watchdog)
        self.left_pid = pids[(self.rank - 1) % self.size]
        self.reader = Reader()
        self.segment_bytes = segment_bytes
        self.scratch = np.empty(self.segment_bytes, np.uint8)  # an in-place reduce's incoming segment
        self._out = [self._slots[i * _SLOT : i * _SLOT + 16].view(np.int64) for i in range(depth)]
        self._in = [self._l_slots[i * _SLOT : i * _SLOT + 16].view(np.int64) for i in range(depth)]

    def segment(self, itemsize: int, seg: int) -> int:
        """Its own segment size (:func:`segment_bytes`), larger than the ring's."""
        return max(1, self.segment_bytes // itemsize)

    def _prepare(self, dtype) -> None:
        pass

    def _give(self, i: int, part) -> None:
        d = self._out[i]
        d[0] = part.ctypes.data
        d[1] = part.nbytes

    def _take(self, i: int, target, own, reduce) -> None:
        addr, nbytes = self._in[i]
        if nbytes != target.nbytes:
            self.watchdog.fail(self.label, f"a segment of {nbytes} bytes where {target.nbytes} were due")
        try:
            at = target.ctypes.data
            if own is None:
                self.reader.read(self.left_pid, at, int(addr), int(nbytes))
            elif own.ctypes.data != at:  # into the target, then add this rank's part there
                self.reader.read(self.left_pid, at, int(addr), int(nbytes))
                reduce(own, target, target)
            else:  # in place: the target holds this rank's part
                self.reader.read(self.left_pid, self.scratch.ctypes.data, int(addr), int(nbytes))
                reduce(own, self.scratch[:nbytes].view(target.dtype), target)
        except OSError as e:  # the others are blocked on this rank: end the job, loudly
            self.watchdog.fail(self.label, str(e))

    def _given_back(self, k: int) -> bool:
        return self._r_consumed[0] >= k


def open_channel(comm: MPI.Comm, segment_bytes: int, depth: int, watchdog) -> DirectChannel | None:
    """A CMA channel (``segment_bytes`` per read) when every rank of ``comm`` shares a
    node with the others and may read its left neighbour's memory, else None.
    Collective over ``comm``."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    if comm.allreduce(shared.size, op=MPI.MIN) != comm.size:
        shared.Free()
        return None
    ok, pids = works(shared)
    if not ok:
        shared.Free()
        return None
    return DirectChannel(shared, segment_bytes, depth, watchdog, pids)
