"""Shared-memory transport for the hand-written ring, when all its ranks share one node.

MPI moves a large message between processes of one node through small shared cells
(8 KiB in MPICH): the sender copies in, the receiver copies out, with a handshake per
cell. Here every rank owns an outbox in an MPI-3 shared window; it copies a segment in,
and its right neighbour reduces (or copies) straight out of it — one copy per segment::

    rank r's window  | full[0..depth) | consumed | slot 0 | slot 1 | ... | slot depth-1 |
                       r's outbox        how much    written by r, read by rank r+1
                       slots are ready   of r-1's
                                         r has taken

Every store goes to the rank's own window and every remote access is a load, so a cache
line crosses between cores once per segment (a push into the neighbour's memory would
move it twice: an ownership request, then the neighbour's read). Segments are numbered
over the channel's life; segment k uses slot k % depth. The writer waits until its right
neighbour's ``consumed > k - depth``, copies, fences (MPI_Win_sync) and sets its own
``full[k % depth] = k + 1``; the reader waits for that on its left neighbour, fences,
reduces or copies the slot into place, fences and sets its own ``consumed = k + 1``.
A rank always takes an arrived segment before it blocks, so the ring cannot deadlock
however few slots there are. The schedule (which chunk, which step) is the ring's own,
so results are bit-identical to the MPI transport.

A rank spinning here makes no MPI call, yet MPI may still need it: a send that completed
in an earlier collective can sit in this rank's queue (Open MPI keeps an eager fragment
there when the peer's shared-memory FIFO is full, and pushes it only from inside an MPI
call), and the peer that waits for it never comes here. So every 1024 idle polls the
loop pokes MPI's progress engine (``MPI_Iprobe``).
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from ... import settings

HEADER = 4096  # bytes: flags (own cache lines for each writer), slots page-aligned
_CONSUMED = 2048  # byte offset of ``consumed``: away from the ``full`` flags' lines


class Channel:
    """The ring's shared-memory outboxes over ``comm`` (every rank on one node)."""

    def __init__(self, comm: MPI.Comm, segment_bytes: int, depth: int, watchdog):
        if depth < 1 or depth * 8 > _CONSUMED:
            raise ValueError(f"shared-memory ring depth must be in [1, {_CONSUMED // 8}], got {depth}")
        self.comm, self.size, self.rank = comm, comm.size, comm.rank
        self.slot_bytes, self.depth, self.watchdog = segment_bytes, depth, watchdog
        # every communicator mpitp makes is an intracommunicator (mpi4py types Split_type as Comm)
        self.win = MPI.Win.Allocate_shared(HEADER + depth * segment_bytes, 1, comm=comm)  # type: ignore[arg-type]
        self._full, self._consumed, self._slots = self._view(self.rank)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Win_sync needs a passive epoch; one per use,
        self._full[:] = 0  # so none is left open at MPI_Finalize
        self._consumed[:] = 0
        self.win.Sync()
        self.win.Unlock_all()
        self._l_full, _, self._l_slots = self._view((self.rank - 1) % self.size)
        _, self._r_consumed, _ = self._view((self.rank + 1) % self.size)
        # more ranks than cores here: a waiting rank hands its core over at once, since the
        # rank it waits for may be queued behind it on the same core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.yield_every = 1 if comm.size > cores else 64
        self.label = "ring over shared memory"  # the call in progress, for the watchdog
        self.progress = None  # called while waiting: other transfers in flight keep moving
        self.received = 0  # segments taken from the left neighbour so far
        self.sent = 0  # segments given to the right neighbour so far
        comm.Barrier()

    def _view(self, rank: int):
        buf, _ = self.win.Shared_query(rank)
        raw = np.frombuffer(buf, np.uint8)  # type: ignore[call-overload]  # mpi4py.buffer: a buffer, unstubbed
        full = raw[: self.depth * 8].view(np.int64)
        consumed = raw[_CONSUMED : _CONSUMED + 8].view(np.int64)
        return full, consumed, raw[HEADER:]

    def free(self) -> None:
        self.win.Free()
        self.comm.Free()

    def run(self, src, dst, incoming, outgoing, first: int, reduce):
        """Move the ring's segments. ``incoming``/``outgoing``: lists of (buffer slices)
        in the order the ring takes and gives them — built by :func:`mpitp.comm.algorithms.ring._channel_pipeline`.

        incoming[j] = (target slice of dst, source slice of src or None): reduce
        ``src_part + slot`` into the target (or copy the slot when there is no source).
        outgoing[k] = a slice to send; those from ``first`` on are ready only once
        incoming[k - first] has been taken (the segment that forwards it)."""
        self._prepare(dst.dtype)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        try:
            self._move(incoming, outgoing, first, reduce)
        finally:
            self.win.Unlock_all()
        self.received += len(incoming)
        self.sent += len(outgoing)
        return dst

    def segment(self, itemsize: int, seg: int) -> int:
        """Elements per segment: the ring's (its slots are cut to fit them)."""
        return seg

    # what a segment is in the slots: its bytes here (a subclass may hand over less)
    def _prepare(self, dtype) -> None:
        size = self.slot_bytes
        self._out = [self._slots[i * size : (i + 1) * size].view(dtype) for i in range(self.depth)]
        self._in = [self._l_slots[i * size : (i + 1) * size].view(dtype) for i in range(self.depth)]

    def _give(self, i: int, part) -> None:
        np.copyto(self._out[i][: part.size], part)

    def _take(self, i: int, target, own, reduce) -> None:
        slot = self._in[i][: target.size]
        if own is None:
            np.copyto(target, slot)
        else:
            reduce(own, slot, target)

    def _given_back(self, k: int) -> bool:
        """Whether the call may return once ``k`` segments are given (the data is in the
        slots: at once)."""
        return True

    def _move(self, incoming, outgoing, first, reduce) -> None:
        depth, sync = self.depth, self.win.Sync
        give, take, given_back = self._give, self._take, self._given_back
        timeout, every, progress = self.watchdog.timeout, self.yield_every, self.progress
        full, consumed, l_full, r_consumed = self._full, self._consumed, self._l_full, self._r_consumed
        base_in, base_out = self.received, self.sent
        n_in, n_out = len(incoming), len(outgoing)
        got = gave = 0
        idle, since = 0, time.monotonic()
        while got < n_in or gave < n_out or not given_back(base_out + n_out):
            moved = False
            while gave < n_out and (gave < first or gave - first < got):
                k = base_out + gave
                if r_consumed[0] <= k - depth:
                    break  # the right neighbour has not taken slot k's last use
                give(k % depth, outgoing[gave])
                sync()
                full[k % depth] = k + 1
                gave += 1
                moved = True
            if got < n_in:
                k = base_in + got
                if l_full[k % depth] == k + 1:
                    sync()
                    target, own = incoming[got]
                    take(k % depth, target, own, reduce)
                    sync()
                    consumed[0] = k + 1
                    got += 1
                    moved = True
            if moved:
                idle = 0
                continue
            idle += 1
            if progress is not None and idle % 8 == 0:
                progress()
            if idle % every == 0:
                os.sched_yield()
            if idle % 1024 == 0:  # a long wait only: it costs a few percent at 64 KiB when every wait pays
                self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # MPI's progress: see the docstring
            if timeout is not None and idle % 64 == 0:
                now = time.monotonic()
                if idle == 64:
                    since = now
                elif now - since > timeout:
                    self.watchdog.abort(self.label)


def max_bytes() -> int:
    """Largest buffer (bytes, the whole collective's) the ring moves over shared memory;
    ``MPITP_SHM_MAX`` overrides the default of 2 MiB. While segments stay in cache this
    transport's two copies win; above, cross-memory attach
    (:mod:`mpitp.comm.transport.cma`) copies each byte once (docs/measurements.md)."""
    return settings.current().shm_max


def enabled() -> bool:
    """``MPITP_SHM=0`` turns the shared-memory transport off (the ring then uses MPI)."""
    return settings.current().shm


def open_channel(comm: MPI.Comm, segment_bytes: int, depth: int, watchdog) -> Channel | None:
    """A channel when every rank of ``comm`` shares memory with the others, else None.
    Collective over ``comm``; every rank gets the same answer."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    if comm.allreduce(shared.size, op=MPI.MIN) != comm.size:
        shared.Free()
        return None
    return Channel(shared, segment_bytes, depth, watchdog)
