"""With validation on, mismatched arguments raise the same CollectiveMismatchError on
every rank (and the communicator stays usable). Meaningful from 2 ranks up."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

import mpitp

N = MPI.COMM_WORLD.size
pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def vcomm():
    c = mpitp.Communicator(validate=True)
    yield c
    c.free()


def raises_everywhere(fn, *fragments):
    """fn() must raise CollectiveMismatchError on every rank with an identical message."""
    try:
        fn()
        msg = None
    except mpitp.CollectiveMismatchError as e:
        msg = str(e)
    msgs = MPI.COMM_WORLD.allgather(msg)
    agree(msg is not None, "no CollectiveMismatchError on this rank")
    agree(len(set(msgs)) == 1, f"messages differ across ranks: {msgs}")
    for f in fragments:
        agree(f in msg, f"{f!r} not in {msg!r}")
    return msg


def test_dtype_mismatch(vcomm):
    last = N - 1
    x = np.ones(8, np.float64 if vcomm.rank == last else np.float32)
    raises_everywhere(lambda: vcomm.allreduce(x), "dtype differs", f"rank {last}: float64", "rank 0: float32")
    raises_everywhere(lambda: vcomm.allgather(x), "dtype differs")


def test_count_and_shape_mismatch(vcomm):
    x = np.ones(8 + (vcomm.rank == 1), np.float32)
    raises_everywhere(lambda: vcomm.allreduce(x, algorithm="ring"), "shape differs", "rank 1: (9,)")
    raises_everywhere(lambda: vcomm.reduce_scatter(x), "shape differs")
    y = np.ones((2, 3 + (vcomm.rank == 1)))
    raises_everywhere(lambda: vcomm.allgather(y), "trailing differs")
    raises_everywhere(lambda: vcomm.broadcast(x), "shape differs")


def test_root_op_algorithm_mismatch(vcomm):
    x = np.ones(4)
    raises_everywhere(lambda: vcomm.reduce(x, root=vcomm.rank % 2), "root differs")
    raises_everywhere(lambda: vcomm.broadcast(x, root=vcomm.rank % 2), "root differs")
    raises_everywhere(lambda: vcomm.allreduce(x, op="max" if vcomm.rank else "sum"), "op differs")
    raises_everywhere(lambda: vcomm.allreduce(x, algorithm="ring" if vcomm.rank else "mpi"), "algorithm differs")


def test_invalid_argument_on_one_rank(vcomm):
    raises_everywhere(
        lambda: vcomm.reduce(np.ones(3), root=N if vcomm.rank == 0 else 0), "invalid arguments", "rank 0", "not a rank"
    )
    bad = np.array(["x"]) if vcomm.rank == 1 else np.ones(1)
    raises_everywhere(lambda: vcomm.allreduce(bad), "rank 1", "cannot be carried")
    raises_everywhere(
        lambda: vcomm.allreduce(np.ones(2), op="mean" if vcomm.rank == 1 else "sum"), "unknown reduction op"
    )


def test_different_collectives(vcomm):
    x = np.ones(4)
    raises_everywhere(lambda: vcomm.allreduce(x) if vcomm.rank else vcomm.allgather(x), "collective differs")


def test_still_usable_after_errors(vcomm):
    y = vcomm.allreduce(np.full(5, vcomm.rank, np.int64))
    agree(np.all(y == N * (N - 1) // 2), "allreduce after validation errors")


def test_env_switch(monkeypatch):
    monkeypatch.setenv("MPITP_VALIDATE", "1")
    c = mpitp.Communicator()
    try:
        agree(c.validate, "MPITP_VALIDATE=1 did not turn validation on")
    finally:
        c.free()


def test_alltoallv_sources_that_do_not_match_what_is_sent(vcomm):
    """alltoallv told how many rows come from each rank (sources=) where rank 0 is told one
    row too many from rank N-1: the same error on every rank, not MPI's truncation or a hang."""
    counts = [1] * N
    told = [1] * N
    if vcomm.rank == 0:
        told[N - 1] = 2
    x = np.ones((N, 3), np.float32)
    raises_everywhere(lambda: vcomm.alltoallv(x, counts, sources=told), "rank 0 was told sources", f"{told}")
    got, came = vcomm.alltoallv(x, counts, sources=[1] * N)
    agree(came == [1] * N and got.shape == (N, 3), "alltoallv with its sources right, after the error")
