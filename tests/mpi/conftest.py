"""Per-rank fixtures. These tests run on every rank at once under mpiexec, so every
assertion is collective: :func:`agree` fails on all ranks together, which keeps the
ranks in step (and hypothesis shrinking in step) instead of leaving some blocked."""
import numpy as np
import pytest
from mpi4py import MPI

import mpitp


@pytest.fixture(scope="session")
def comm():
    c = mpitp.Communicator()
    yield c
    c.free()


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
            lo, hi = ((-3, 4) if op == "prod" else (-100, 101)) if dtype.kind == "i" else ((0, 4) if op == "prod" else (0, 101))
            a = rng.integers(lo, hi, shape).astype(dtype)
        elif dtype.kind == "c":
            a = (rng.uniform(0.5, 1.5, shape) + 1j * rng.uniform(-0.5, 0.5, shape)).astype(dtype)
        elif op == "prod":
            a = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            a = rng.standard_normal(shape).astype(dtype)
        out.append(a)
    return out
