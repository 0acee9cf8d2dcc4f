"""Barrier and point-to-point calls, counted by peer class like everything else."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import backend
from .algorithms import mpi_collectives
from .base import CommunicatorBase
from .handle import Handle
from .mpi_types import mpi_datatype


class PointToPoint(CommunicatorBase):
    def barrier(self, *, nonblocking: bool = False):
        seq, label = self._begin("barrier")
        if self.validate:
            self._exchange_check(label, {"collective": "barrier"}, ("collective",), None)
        return self._run(mpi_collectives.barrier(self.mpi, self._call_blocking(nonblocking)), label, nonblocking)

    def send(self, x, dest: int, tag: int = 0) -> None:
        a = self._array(x)
        if self._via_host(a):
            a = self._to_host(a)
        self.traffic.record(a.nbytes, "send", self.topology.peer_class(dest))
        req = self.mpi.Isend([a, mpi_datatype(a.dtype)], dest=dest, tag=tag)
        self.watchdog.wait([req], f"send to rank {dest} (tag {tag})")  # a receiver that never comes: an abort

    def isend(self, x, dest: int, tag: int = 0) -> Handle:
        """Send ``x`` without waiting: ``wait()`` on the handle returns once the message has
        left (the handle keeps the buffer alive until then; do not change it before)."""
        a = self._array(x)
        if self._via_host(a):
            a = self._to_host(a)
        self.traffic.record(a.nbytes, "send", self.topology.peer_class(dest))

        def steps():
            yield self.mpi.Isend([a, mpi_datatype(a.dtype)], dest=dest, tag=tag)

        return Handle(steps(), self.watchdog, f"isend to rank {dest} (tag {tag})")

    def recv(self, source: int = MPI.ANY_SOURCE, *, out=None, shape=None, dtype=None, tag: int = MPI.ANY_TAG):
        """Receive into ``out``, or into a new array of ``shape``/``dtype``; with only
        ``dtype`` the message length decides (a 1-D array). The wait goes through the
        watchdog: a sender that never sends (a rank that failed before it) aborts the job
        after MPITP_TIMEOUT instead of hanging it."""
        label = f"recv from rank {source} (tag {tag})"
        if out is None:
            if dtype is None:
                raise TypeError("recv needs out=, or dtype= (and optionally shape=)")
            dtype = np.dtype(dtype)
            if shape is None:
                status = MPI.Status()
                if self.watchdog.timeout is None:
                    self.mpi.Probe(source, tag, status)
                else:
                    self.watchdog.until(lambda: self.mpi.Iprobe(source, tag, status), label)
                shape = (status.Get_count(mpi_datatype(dtype)),)
                source, tag = status.Get_source(), status.Get_tag()
            out = np.empty(shape, dtype)
        if backend.is_device(out) and self._via_host(out):
            host = np.empty(out.shape, out.dtype)
            self.watchdog.wait([self.mpi.Irecv([host, mpi_datatype(out.dtype)], source=source, tag=tag)], label)
            backend.device_ops(out).from_host(out, host)
            return out
        buf = out if backend.is_device(out) or out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        self.watchdog.wait([self.mpi.Irecv([buf, mpi_datatype(out.dtype)], source=source, tag=tag)], label)
        return self._finish(buf, out)

    def sendrecv(
        self, x, dest: int, source: int | None = None, *, out=None, sendtag: int = 0, recvtag: int = MPI.ANY_TAG
    ):
        """Send ``x`` to ``dest`` while receiving a same-shaped array from ``source``."""
        a = self._array(x)
        source = dest if source is None else source
        if self._via_host(a):
            h = self._to_host(a)
            r = np.empty_like(h)
            self.traffic.record(h.nbytes, "sendrecv", self.topology.peer_class(dest))
            dt = mpi_datatype(h.dtype)
            self._sendrecv([h, dt], dest, sendtag, [r, dt], source, recvtag)
            dev = out if out is not None else backend.empty(r.shape, r.dtype, x)
            backend.device_ops(x).from_host(dev, r)
            return dev
        buf = self._out_buffer(out, a, a.shape)
        self.traffic.record(a.nbytes, "sendrecv", self.topology.peer_class(dest))
        dt = mpi_datatype(a.dtype)
        self._sendrecv([a, dt], dest, sendtag, [buf, dt], source, recvtag)
        return self._finish(buf, out)

    def _sendrecv(self, send, dest: int, sendtag: int, recv, source: int, recvtag: int) -> None:
        """MPI's Sendrecv as its two halves, waited on through the watchdog."""
        reqs = [self.mpi.Irecv(recv, source=source, tag=recvtag), self.mpi.Isend(send, dest=dest, tag=sendtag)]
        self.watchdog.wait(reqs, f"sendrecv with ranks {dest} and {source}")
