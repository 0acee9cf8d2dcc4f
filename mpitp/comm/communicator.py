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

from .gathers import Gathers
from .objects import ObjectCollectives
from .p2p import PointToPoint
from .reductions import Reductions


class Communicator(Reductions, Gathers, PointToPoint, ObjectCollectives):
    """A duplicated MPI communicator with array collectives, algorithms and counters.

    >>> comm = Communicator()                      # Dup of MPI.COMM_WORLD
    >>> y = comm.allreduce(x, op="sum")            # new array on every rank
    >>> cfg = comm.on_root(read_config)            # rank 0 reads; every rank gets it (or its error)
    >>> with Communicator() as comm: ...           # freed at the end of the block
    """
