"""What the hand-written ring runs over: MPI's point-to-point calls, or a channel
between the ranks of one node.

    a blocking call on host arrays whose ranks all share a node:
        whole buffer <= shm_max_bytes  ->  shm.Channel   two copies through a shared window
        larger                         ->  cma.Channel   one copy, process_vm_readv
    otherwise, or where that channel is off or cannot open  ->  the MPI communicator

Every rank of a call decides alike (same flags, sizes, kind of buffer, open channels),
so the ring's two neighbours never disagree on the transport.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from mpi4py import MPI

from . import cma, shm
from .shm import Channel

__all__ = ["Channel", "Links", "RingSettings", "cma", "shm"]


class RingSettings(Protocol):
    """The knobs a communicator exposes for its ring (see :class:`mpitp.Communicator`)."""

    shm: bool  # MPITP_SHM
    shm_max_bytes: int  # MPITP_SHM_MAX: the largest buffer the shared window takes
    cma: bool  # MPITP_CMA
    cma_segment_bytes: int
    segment_bytes: int  # MPITP_RING_SEGMENT
    ring_depth: int  # MPITP_RING_DEPTH: receive segments in flight


class Links:
    """The channels a communicator has opened, one per scope: ``"flat"`` (all ranks),
    ``"intra"`` (this rank's node), with ``"/cma"`` added for single-copy channels."""

    def __init__(self, watchdog, meta: MPI.Comm):
        self.watchdog, self._meta = watchdog, meta
        # scope -> (slot bytes, depth, channel or None where it cannot open)
        self._open: dict[str, tuple[int, int, Channel | None]] = {}

    def pick(
        self, comm: MPI.Comm, a, nbytes: int, nonblocking: bool, label: str, scope: str, knobs: RingSettings
    ) -> MPI.Comm | Channel:
        """The transport for one ring over ``comm``: ``nbytes`` is the call's whole buffer,
        the same on every rank. Collective over the whole communicator (``meta``'s ranks),
        even when ``comm`` is one rank's node alone: opening waits for every rank."""
        if nonblocking or self._meta.size == 1 or type(a) is not np.ndarray:
            return comm
        if nbytes <= knobs.shm_max_bytes:
            if not knobs.shm:
                return comm
            seg = max(1, knobs.segment_bytes // a.dtype.itemsize) * a.dtype.itemsize
            slot = -(-max(seg, knobs.segment_bytes) // 64) * 64
            ch = self._channel(scope, comm, slot, knobs.ring_depth, shm.open_channel, label)
        else:
            if not knobs.cma:
                return comm
            ch = self._channel(scope + "/cma", comm, knobs.cma_segment_bytes, knobs.ring_depth, cma.open_channel, label)
        if ch is None:
            return comm
        ch.label = label  # what the watchdog names if this call never completes
        return ch

    def _channel(self, key: str, comm: MPI.Comm, slot: int, depth: int, opener, label: str) -> Channel | None:
        """The channel ``opener`` makes over ``comm`` (None where it cannot), opened on
        first use and again when the slot size or the depth changes."""
        link = self._open.get(key)
        if link is None or link[0] != slot or link[1] != depth:
            # opening is a blocking collective: first make sure every rank is in this call,
            # under the watchdog, so a rank that never comes aborts the job instead of hanging it
            self.watchdog.wait([self._meta.Ibarrier()], label)
            if link is not None and link[2] is not None:
                link[2].free()
            ch = opener(comm, slot, depth, self.watchdog) if comm.size > 1 else None
            link = self._open[key] = (slot, depth, ch)
        return link[2]

    def opened(self) -> dict[str, bool]:
        """Scope -> whether its channel opened (tests and ``mpitp bench`` read it)."""
        return {k: ch is not None for k, (_, _, ch) in self._open.items()}

    def free(self) -> None:
        for _, _, ch in self._open.values():
            if ch is not None:
                ch.free()
        self._open.clear()
