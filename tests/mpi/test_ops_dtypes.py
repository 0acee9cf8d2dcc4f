"""bfloat16, avg and the bitwise ops through every algorithm, against NumPy references:
bf16 sums against the float32 sum rounded once to bf16 (each hop of a ring or tree rounds
once more, so within N-1 bf16 roundings of the partial sums), avg against the mean,
bitwise ops exactly; bf16 moves through every collective unchanged."""

import ml_dtypes
import numpy as np
import pytest
from helpers import agree, same_on_all_ranks
from mpi4py import MPI

from mpitp.comm.mpi_types import ReduceOp, mpi_datatype, mpi_op
from mpitp.errors import UnsupportedOperation

BF16 = np.dtype(ml_dtypes.bfloat16)
N = MPI.COMM_WORLD.size
ALGS = ["mpi", "ring", "hierarchical", "hierarchical_leader", "auto"]


def inputs(count, seed, dtype=np.float32):
    return [np.random.default_rng(seed * 100 + r).standard_normal(count).astype(dtype) for r in range(N)]


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("count", [1, 7, 1000, 70001])
def test_bfloat16_sum(comm, algorithm, count):
    xs = [x.astype(BF16) for x in inputs(count, 1)]
    y = comm.allreduce(xs[comm.rank], algorithm=algorithm)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    once = exact.astype(np.float32).astype(BF16).astype(np.float64)
    # each of the N-1 additions rounds to bf16 (u = 2^-8) on partial sums <= sum |x|
    bound = (N - 1) * 2.0**-8 * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0) + np.abs(once - exact)
    agree(y.dtype == BF16 and y.shape == (count,), f"dtype {y.dtype}")
    agree(bool(np.all(np.abs(y.astype(np.float64) - exact) <= bound * (1 + 1e-9))), "bf16 sum within its rounding")
    agree(same_on_all_ranks(y), "bit-identical on every rank")


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", ["float32", "float64", BF16])
def test_avg(comm, algorithm, dtype):
    xs = [x.astype(dtype) for x in inputs(333, 2)]
    y = comm.allreduce(xs[comm.rank], op="avg", algorithm=algorithm)
    mean = np.mean([x.astype(np.float64) for x in xs], axis=0)
    tol = (N * 2.0**-7) if np.dtype(dtype) == BF16 else (N * np.finfo(dtype).eps)
    agree(bool(np.allclose(y.astype(np.float64), mean, rtol=tol, atol=tol)), "avg = mean")
    agree(same_on_all_ranks(y), "bit-identical")


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_avg_other_reductions(comm, collective):
    xs = inputs(4 * N, 3, np.float64)
    mean = np.mean(xs, axis=0)
    if collective == "reduce":
        y = comm.reduce(xs[comm.rank], op="avg", root=N - 1)
        agree(y is None if comm.rank != N - 1 else bool(np.allclose(y, mean)), "reduce avg at root")
    else:
        y = comm.reduce_scatter(xs[comm.rank], op="avg")
        agree(bool(np.allclose(y, np.array_split(mean, N)[comm.rank])), "reduce_scatter avg")


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("op,fn", [("band", np.bitwise_and), ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)])
@pytest.mark.parametrize("dtype", ["int32", "uint8", "int64", "bool"])
def test_bitwise(comm, algorithm, op, fn, dtype):
    xs = [np.random.default_rng(7 + r).integers(0, 256, 517).astype(dtype) for r in range(N)]
    y = comm.allreduce(xs[comm.rank], op=op, algorithm=algorithm)
    agree(bool(np.array_equal(y, fn.reduce(np.stack(xs), axis=0))), f"{op} on {dtype}")


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_bfloat16_moves_unchanged(comm, algorithm):
    x = inputs(9, 4)[comm.rank].astype(BF16)
    g = comm.allgather(x, algorithm=algorithm)
    agree(
        g.dtype == BF16
        and np.array_equal(g.view(np.uint16), np.concatenate([v.astype(BF16) for v in inputs(9, 4)]).view(np.uint16)),
        "allgather bf16 bit for bit",
    )
    b = comm.broadcast(x.copy(), root=0)
    agree(np.array_equal(b.view(np.uint16), inputs(9, 4)[0].astype(BF16).view(np.uint16)), "broadcast bf16")


@pytest.mark.parametrize("op,dtype", [("avg", "int32"), ("bxor", "float32"), ("band", BF16)])
def test_meaningless_combinations_refused(comm, op, dtype):
    with pytest.raises(UnsupportedOperation):
        comm.allreduce(np.ones(3, dtype), op=op)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "complex128"])
def test_mpi_reduces_with_its_own_op(comm, dtype):
    """``algorithm="mpi"`` hands MPI a predefined datatype, on which MPI's own SUM is
    defined: a duplicate of it (what mpi4py's ``dtlib`` returns) made MPICH refuse SUM and
    every reduction fall back to a Python user op, ~4x slower for a small message."""
    dt = mpi_datatype(np.dtype(dtype))
    agree(dt.is_predefined, f"{dtype} travels as {dt.Get_name() or 'a derived datatype'}")
    agree(mpi_op(ReduceOp.SUM, np.dtype(dtype)) == MPI.SUM, f"{dtype} sums with a user op")
    x = inputs(5, 3)[comm.rank].astype(dtype)
    y = comm.allreduce(x, algorithm="mpi")
    agree(np.array_equal(y, MPI.COMM_WORLD.allreduce(x, op=MPI.SUM)), f"{dtype}: not MPI's own sum")
