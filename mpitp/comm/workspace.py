"""Reusable scratch buffers for the hand-written algorithms.

A large ``numpy.empty`` is a fresh ``mmap``: the first touch of every page faults, which
on big messages costs as much as the copy itself (the reason the mpich wheel's own
Allreduce is slow at 64 MiB). Keeping the ring's receive buffers alive between calls
pays that once. Buffers are borrowed and returned, so concurrent nonblocking
collectives never share one.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .. import backend


class Workspace:
    def __init__(self, keep: int = 4):
        self._free: list[np.ndarray] = []  # uint8 host buffers
        self._keep = keep

    @contextmanager
    def borrow(self, count: int, dtype, like):
        """A flat array of ``count`` elements of ``dtype`` on ``like``'s device."""
        dtype = np.dtype(dtype)
        if backend.is_device(like):  # device pools (CuPy's allocator) already cache
            yield backend.empty((count,), dtype, like)
            return
        nbytes = max(count * dtype.itemsize, 1)
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        else:
            buf = np.empty(nbytes, np.uint8)
        try:
            yield buf[: count * dtype.itemsize].view(dtype)
        finally:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.sort(key=lambda b: b.nbytes)
                self._free.pop(0)
