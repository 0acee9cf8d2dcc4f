"""Object collectives on the Communicator (comm/objects.py), checked against MPI's own
object collectives on COMM_WORLD: rank 0 decides and every rank returns its result or
raises its error; ``agree`` raises the same error, naming the failed ranks, on every rank;
``poll_bcast`` delivers rank 0's object whether the others wait in MPI or poll."""

import pytest
from helpers import agree
from mpi4py import MPI

from mpitp.errors import MpitpError

W = MPI.COMM_WORLD
N = W.size


def test_object_collectives_equal_mpis(comm):
    mine = {"rank": comm.rank, "x": [comm.rank] * 3}
    agree(comm.bcast_object(mine, root=N - 1) == W.bcast(mine, root=N - 1), "bcast")
    agree(comm.allgather_object(mine) == W.allgather(mine), "allgather")
    got, want = comm.gather_object(mine, root=N - 1), W.gather(mine, root=N - 1)
    agree(got == want and (got is None) == (comm.rank != N - 1), f"gather: {got}")
    agree(comm.allreduce_object(comm.rank + 1) == N * (N + 1) // 2, "sum")
    agree(comm.allreduce_object(comm.rank, op="max") == N - 1 and comm.allreduce_object(comm.rank, op="min") == 0, "")
    agree(comm.all_true(True) and not comm.all_true(comm.rank != N - 1), "all_true")


def test_on_root_returns_roots_result_or_raises_its_error_everywhere(comm):
    calls = []

    def decide():
        calls.append(comm.rank)
        return {"chosen": 42}

    agree(comm.on_root(decide) == {"chosen": 42}, "result")
    agree(calls == ([0] if comm.rank == 0 else []), f"ran on rank 0 only: {calls}")

    def fail():
        raise MpitpError("no such model: nowhere")

    with pytest.raises(MpitpError, match="no such model: nowhere"):
        comm.on_root(fail)


def test_agree_raises_the_same_error_on_every_rank_naming_the_failed_ones(comm):
    comm.agree(None, "nothing failed")  # returns on every rank
    err = OSError("disk full") if comm.rank in (0, N - 1) else None
    with pytest.raises(MpitpError) as e:
        comm.agree(err, "saving")
    failed = sorted({0, N - 1})
    want = "saving: disk full" if N == 1 else "saving: " + "; ".join(f"rank {r}: disk full" for r in failed)
    agree(str(e.value) == want, str(e.value))


@pytest.mark.parametrize("busy", [True, False])
def test_poll_bcast_delivers_rank_0s_object(comm, busy):
    for i in range(3):
        msg = {"step": i, "jobs": list(range(i * 100))} if comm.rank == 0 else None
        got = comm.poll_bcast(msg, busy=busy)
        agree(got == {"step": i, "jobs": list(range(i * 100))}, f"step {i}")
