"""MPI's own collectives, written as step generators.

With ``direct=True`` (blocking call, no watchdog) each generator makes MPI's blocking
call and yields nothing; otherwise it posts the nonblocking variant and yields its
request, so the watchdog and nonblocking handles see it. Buffers are contiguous
NumPy arrays, or device arrays when MPI is CUDA-aware; messages are ``[buf, datatype]``
(``[buf, counts, displs, datatype]`` for the v-variants).
"""

from __future__ import annotations

from mpi4py import MPI

from ..handle import Steps


def allreduce(comm: MPI.Comm, send, recv, dt, op, direct: bool) -> Steps:
    sbuf = MPI.IN_PLACE if send is recv else [send, dt]
    if direct:
        comm.Allreduce(sbuf, [recv, dt], op=op)
    else:
        yield comm.Iallreduce(sbuf, [recv, dt], op=op)
    return recv


def reduce(comm: MPI.Comm, send, recv, dt, op, root: int, direct: bool) -> Steps:
    if comm.rank == root:
        sbuf, rbuf = (MPI.IN_PLACE if send is recv else [send, dt]), [recv, dt]
    else:
        sbuf, rbuf = [send, dt], None
    if direct:
        comm.Reduce(sbuf, rbuf, op=op, root=root)
    else:
        yield comm.Ireduce(sbuf, rbuf, op=op, root=root)
    return recv if comm.rank == root else None


def bcast(comm: MPI.Comm, buf, dt, root: int, direct: bool) -> Steps:
    if direct:
        comm.Bcast([buf, dt], root=root)
    else:
        yield comm.Ibcast([buf, dt], root=root)
    return buf


def gatherv(comm: MPI.Comm, send, recv, counts, dt, root: int, direct: bool) -> Steps:
    rbuf = [recv, (counts, None), dt] if comm.rank == root else None
    if direct:
        comm.Gatherv([send, dt], rbuf, root=root)
    else:
        yield comm.Igatherv([send, dt], rbuf, root=root)
    return recv if comm.rank == root else None


def allgatherv(comm: MPI.Comm, send, recv, counts, dt, direct: bool) -> Steps:
    if all(c == counts[0] for c in counts):  # equal pieces: MPI's Allgather has the better algorithms
        if direct:
            comm.Allgather([send, dt], [recv, counts[0], dt])
        else:
            yield comm.Iallgather([send, dt], [recv, counts[0], dt])
        return recv
    if direct:
        comm.Allgatherv([send, dt], [recv, (counts, None), dt])
    else:
        yield comm.Iallgatherv([send, dt], [recv, (counts, None), dt])
    return recv


def scatterv(comm: MPI.Comm, send, recv, counts, dt, root: int, direct: bool) -> Steps:
    sbuf = [send, (counts, None), dt] if comm.rank == root else None
    if direct:
        comm.Scatterv(sbuf, [recv, dt], root=root)
    else:
        yield comm.Iscatterv(sbuf, [recv, dt], root=root)
    return recv


def reduce_scatter(comm: MPI.Comm, send, recv, counts, dt, op, direct: bool) -> Steps:
    if direct:
        comm.Reduce_scatter([send, dt], [recv, dt], recvcounts=counts, op=op)
    else:
        yield comm.Ireduce_scatter([send, dt], [recv, dt], recvcounts=counts, op=op)
    return recv


def alltoall(comm: MPI.Comm, send, recv, dt, direct: bool) -> Steps:
    if direct:
        comm.Alltoall([send, dt], [recv, dt])
    else:
        yield comm.Ialltoall([send, dt], [recv, dt])
    return recv


def alltoallv(comm: MPI.Comm, send, send_counts, recv, recv_counts, dt, direct: bool) -> Steps:
    """``send_counts[j]`` elements of ``send`` to rank j, ``recv_counts[j]`` from rank j (packed)."""
    sbuf, rbuf = [send, (send_counts, None), dt], [recv, (recv_counts, None), dt]
    if direct:
        comm.Alltoallv(sbuf, rbuf)
    else:
        yield comm.Ialltoallv(sbuf, rbuf)
    return recv


def barrier(comm: MPI.Comm, direct: bool) -> Steps:
    if direct:
        comm.Barrier()
    else:
        yield comm.Ibarrier()
