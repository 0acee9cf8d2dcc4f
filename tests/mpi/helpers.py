"""Helpers of the per-rank suites: collective assertions and the references results are
checked against. These tests run on every rank at once under mpiexec, so every assertion
is collective: :func:`agree` fails on all ranks together, which keeps the ranks in step
(and hypothesis shrinking in step) instead of leaving some blocked."""

import zlib

import numpy as np
import pytest
from mpi4py import MPI


def agree(cond: bool, msg: str = "") -> None:
    """Fail on every rank if ``cond`` is false on any rank, naming those ranks."""
    flags = MPI.COMM_WORLD.allgather((bool(cond), msg if not cond else ""))
    bad = [(r, m) for r, (ok, m) in enumerate(flags) if not ok]
    if bad:
        pytest.fail("; ".join(f"rank {r}: {m}" for r, m in bad), pytrace=False)


def rank_inputs(shape, dtype, op, size, seed):
    """Every rank's input, generated identically on every rank (so each rank can compute
    the NumPy reference locally)."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(size):
        rng = np.random.default_rng(seed * 1000 + r)
        if dtype == np.bool_:
            a = rng.integers(0, 2, shape).astype(bool)
        elif dtype.kind in "iu":
            lo, hi = (
                ((-3, 4) if op == "prod" else (-100, 101))
                if dtype.kind == "i"
                else ((0, 4) if op == "prod" else (0, 101))
            )
            a = rng.integers(lo, hi, shape).astype(dtype)
        elif dtype.kind == "c":
            a = (rng.uniform(0.5, 1.5, shape) + 1j * rng.uniform(-0.5, 0.5, shape)).astype(dtype)
        elif op == "prod":
            a = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            a = rng.standard_normal(shape).astype(dtype)
        out.append(a)
    return out


def bound(inputs, op, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind not in "fc" or op in ("max", "min") or MPI.COMM_WORLD.size == 1:
        return 0.0
    u = np.finfo(dtype).eps / 2
    g = (MPI.COMM_WORLD.size - 1) * u / (1 - (MPI.COMM_WORLD.size - 1) * u)
    stack = np.stack([np.abs(a.astype(np.complex128 if dtype.kind == "c" else np.float64)) for a in inputs])
    if op == "sum":
        return 2 * g * stack.sum(axis=0)
    return 2 * g * (4 if dtype.kind == "c" else 1) * stack.prod(axis=0)


def mpi_reference(x, op):
    """MPI's own all-reduce of ``x`` over the world, through mpi4py directly (no mpitp)."""
    from mpitp.comm.ops import ReduceOp, mpi_datatype, mpi_op

    y = np.empty_like(x)
    dt = mpi_datatype(x.dtype)
    MPI.COMM_WORLD.Allreduce([x, dt], [y, dt], op=mpi_op(ReduceOp(op), x.dtype))
    return y


def numpy_reference(inputs, op):
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    acc = inputs[0].copy()
    for a in inputs[1:]:
        acc = fn(acc, a)
    return acc


def close(a, b, tol):
    if np.dtype(a.dtype).kind in "fc":
        diff = np.abs(a.astype(np.complex128) - b.astype(np.complex128))
        return bool(np.all(diff <= tol * (1 + 1e-6) + np.finfo(a.dtype).tiny))
    return bool(np.array_equal(a, b))


def same_on_all_ranks(y) -> bool:
    digests = MPI.COMM_WORLD.allgather(zlib.crc32(np.ascontiguousarray(y).tobytes()))
    return len(set(digests)) == 1


def cma_permitted() -> bool:
    """Whether this node lets a rank read its neighbour's memory (the CMA transport's
    own probe: ptrace permission, no seccomp filter in the way). Collective."""
    from mpitp.comm.transport import cma

    world = MPI.COMM_WORLD
    return world.size == 1 or cma.works(world)[0]
