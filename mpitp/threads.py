"""BLAS/OpenMP threads per rank: one pool per core, not one per core per rank.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core in every process. Under
``mpiexec -n 3`` on a 2-core node that is 6 busy-waiting threads on 2 cores, and a
tensor-parallel decode step runs ~40x slower. Like ``torchrun`` (which sets
``OMP_NUM_THREADS=1`` for several processes per node), mpitp gives each rank
``cores // ranks on this node`` threads (at least 1) — only where the launcher says
there are several ranks here, only for variables the user has not set, and only if
NumPy has not been imported yet (its BLAS reads them once, at load).
``bin/mpitp-rank-env --threads N`` sets them explicitly on clusters.
"""
from __future__ import annotations

import os
import re
import sys

VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def local_ranks(environ=os.environ) -> int | None:
    """Ranks on this node, from the launcher's environment (MPICH hydra, Open MPI, srun)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if environ.get(var, "").strip().isdigit():
            return int(environ[var])
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if tasks and environ.get("SLURM_LOCALID") is not None:
        m = re.match(r"\s*(\d+)", tasks)              # "2(x3)" or "3,2": the first node's count
        return int(m.group(1)) if m else None
    return None


def cores(environ=os.environ) -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_default_threads(environ=os.environ, modules=sys.modules) -> int | None:
    """Set the thread variables the user left unset; returns the count set, or None."""
    n = local_ranks(environ)
    if not n or n <= 1 or "numpy" in modules or all(v in environ for v in VARS):
        return None
    per = max(1, cores(environ) // n)
    for var in VARS:
        environ.setdefault(var, str(per))
    return per
