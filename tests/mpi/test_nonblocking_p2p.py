"""Nonblocking handles (several in flight at once) and point-to-point calls."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

N = MPI.COMM_WORLD.size


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_several_handles_in_flight(comm, algorithm):
    xs = [np.full(1000 + k, comm.rank + k, np.float64) for k in range(3)]
    hs = [comm.allreduce(x, algorithm=algorithm, nonblocking=True) for x in xs]
    g = comm.allgather(np.array([comm.rank]), nonblocking=True)
    results = [h.wait() for h in reversed(hs)][::-1]
    for k, y in enumerate(results):
        agree(np.all(y == sum(r + k for r in range(N))), f"handle {k}")
    agree(np.array_equal(g.wait(), np.arange(N)), "allgather handle")
    h = comm.reduce_scatter(np.ones(2 * N), algorithm=algorithm, nonblocking=True)
    while not h.test():
        pass
    agree(np.all(h.wait() == N), "reduce_scatter handle via test()")


def test_nonblocking_rooted(comm):
    b = np.arange(4.0) if comm.rank == 0 else np.zeros(4)
    comm.broadcast(b, nonblocking=True).wait()
    agree(np.array_equal(b, np.arange(4.0)), "broadcast handle")
    s = comm.scatter(np.arange(N * 2) if comm.rank == 0 else None, nonblocking=True).wait()
    agree(np.array_equal(s, [2 * comm.rank, 2 * comm.rank + 1]), "scatter handle")
    comm.barrier(nonblocking=True).wait()


def test_ring_of_sends(comm):
    right, left = (comm.rank + 1) % N, (comm.rank - 1) % N
    x = np.arange(6, dtype=np.int32).reshape(2, 3) + comm.rank
    got = comm.sendrecv(x, dest=right, source=left)
    agree(np.array_equal(got, np.arange(6).reshape(2, 3) + left), "sendrecv")
    if N > 1:
        ok = True
        if comm.rank == 0:
            comm.send(np.arange(5, dtype=np.float32), dest=1, tag=7)
            comm.send(np.arange(3, dtype=np.float32)[::-1], dest=1, tag=8)
        elif comm.rank == 1:
            a = comm.recv(0, dtype=np.float32, tag=7)
            out = np.empty(6, np.float32)
            comm.recv(0, out=out[::2], tag=8)
            ok = np.array_equal(a, np.arange(5)) and np.array_equal(out[::2], [2, 1, 0])
        agree(ok, "send/recv")


def test_isend_lets_every_rank_send_before_anyone_receives(fresh_comm):
    """A ring where each rank first sends 4 MB (past any eager limit: blocking sends would
    deadlock) and only then receives; the handle keeps the buffer until wait(). The bytes
    sent are in the traffic counters (the pipeline's hand-over is an isend: its bytes are
    checked against the plan through them)."""
    comm = fresh_comm
    right, left = (comm.rank + 1) % N, (comm.rank - 1) % N
    h = comm.isend(np.full(1 << 20, comm.rank, np.float32), dest=right, tag=3)
    got = comm.recv(left, out=np.empty(1 << 20, np.float32), tag=3)
    h.wait()
    agree(h.done and np.all(got == left), "isend ring")
    t = comm.traffic
    agree(t.by_collective["send"] == 4 << 20 and t.total == 4 << 20, f"isend counted {dict(t.by_collective)}")
