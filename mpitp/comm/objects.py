"""Collectives of Python objects (pickled by mpi4py), and the patterns built on them that
commands use: one rank decides and every rank learns the result or the same error; every
rank checks and all fail alike; an idle server's ranks wait for rank 0 without spinning.

    on_root(fn):        rank 0 runs fn ──bcast──▶ every rank returns its result,
                        or raises the error rank 0 got
    agree(err, what):   each rank's error ──allgather──▶ every rank raises one error
                        naming the ranks that failed (or none does)
    poll_bcast(obj):    rank 0's obj on every rank; the others sleep between tests of a
                        nonblocking broadcast when ``busy`` is False

Not counted in the traffic counters (they count array payloads); these carry control
messages of a few bytes to a few kilobytes.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from ..errors import MpitpError
from .base import CommunicatorBase

T = TypeVar("T")

DECIDE_ERRORS: tuple[type[BaseException], ...] = (MpitpError, OSError, ValueError)


class ObjectCollectives(CommunicatorBase):
    def bcast_object(self, obj: T, root: int = 0) -> T:
        """``root``'s ``obj`` on every rank."""
        return obj if self.size == 1 else self.mpi.bcast(obj, root=root)

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None:
        """Every rank's ``obj``, in rank order, on ``root`` (None elsewhere)."""
        return [obj] if self.size == 1 else self.mpi.gather(obj, root=root)

    def allgather_object(self, obj: T) -> list[T]:
        return [obj] if self.size == 1 else self.mpi.allgather(obj)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return bool(flag) if self.size == 1 else bool(self.mpi.allreduce(bool(flag), op=MPI.LAND))

    def allreduce_object(self, value, op: str = "sum"):
        """A number (or anything MPI's object reduction takes) reduced over the ranks:
        ``sum``, ``min`` or ``max``."""
        ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
        return value if self.size == 1 else self.mpi.allreduce(value, op=ops[op])

    def on_root(self, fn: Callable[[], T], errors: tuple[type[BaseException], ...] = DECIDE_ERRORS) -> T:
        """Run ``fn`` on rank 0 and return its result on every rank; if it raised one of
        ``errors``, every rank raises that error."""
        res: Any = None
        err: BaseException | None = None
        if self.rank == 0:
            try:
                res = fn()
            except errors as e:
                err = e
        res, err = self.bcast_object((res, err))
        if err is not None:
            raise err
        return res

    def agree(self, err: BaseException | None, what: str, kind: type[Exception] = MpitpError) -> None:
        """Every rank's ``err`` (None: this rank is fine); if any rank failed, every rank
        raises ``kind("what: rank r: message; ...")``."""
        msgs = self.allgather_object(str(err) if err else "")
        bad = [(r, m) for r, m in enumerate(msgs) if m]
        if len(bad) == 1 and len(msgs) == 1:
            raise kind(f"{what}: {bad[0][1]}")
        if bad:
            raise kind(f"{what}: " + "; ".join(f"rank {r}: {m}" for r, m in bad))

    def poll_bcast(self, obj: T, busy: bool, root: int = 0, nap: float = 0.0005) -> T:
        """``root``'s ``obj`` on every rank. ``busy``: the message is due soon, so the other
        ranks wait inside MPI; otherwise they test a nonblocking broadcast between naps of
        ``nap`` seconds, leaving the cores to the root's other threads (an idle server)."""
        if self.size == 1:
            return obj
        data = pickle.dumps(obj) if self.rank == root else b""
        size = np.array([len(data)], np.int64)
        req = self.mpi.Ibcast(size, root=root)
        if busy:
            req.Wait()
        while not req.Test():
            time.sleep(nap)
        buf = bytearray(data) if self.rank == root else bytearray(int(size[0]))
        self.mpi.Bcast(buf, root=root)
        return obj if self.rank == root else pickle.loads(bytes(buf))
