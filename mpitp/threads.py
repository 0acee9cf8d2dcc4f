"""BLAS/OpenMP threads per rank: one pool per core, not one per core per rank.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core in every process. Under
``mpiexec -n 3`` on a 2-core node that is 6 busy-waiting threads on 2 cores, and a
tensor-parallel decode step runs tens of times slower (docs/measurements.md). Like ``torchrun`` (which sets
``OMP_NUM_THREADS=1`` for several processes per node), mpitp gives each rank
``cores // ranks on this node`` threads (at least 1; cores = this process's affinity
mask) — or, inside a SLURM step, ``SLURM_CPUS_PER_TASK``, which the site or user chose —
only where the launcher says there are several ranks here (or SLURM says how many CPUs a
task has), only for variables the user has not set, and only if NumPy has not been
imported yet (its BLAS reads them once, at load). ``CHOICE`` says what was decided and
why (``mpitp info`` prints it).
``MPITP_THREADS=N`` (the int8 kernels' threads per rank, :mod:`mpitp.kernels.parallel`)
gives BLAS the same N; ``bin/mpitp-rank-env --threads N`` sets them explicitly on clusters.
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
        m = re.match(r"\s*(\d+)", tasks)  # "2(x3)" or "3,2": the first node's count
        return int(m.group(1)) if m else None
    return None


def cores(environ=os.environ) -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


CHOICE: tuple[int | None, str] = (None, "not decided")


def local_rank(environ=os.environ) -> int | None:
    """This process's rank among those on its node, from the launcher's environment."""
    for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        if environ.get(var, "").strip().isdigit():
            return int(environ[var])
    return None


def choose(environ=os.environ) -> tuple[int | None, str]:
    """(threads per rank, why); None: leave the BLAS default."""
    from . import settings

    try:
        own = settings.Settings.from_env(environ).threads
    except settings.SettingsError:
        own = 1  # a bad value is reported where the kernels read it
    if own > 1:  # the kernels' threads per rank: BLAS (prefill of float weights) the same
        return own, "MPITP_THREADS"
    cpus = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpus.isdigit() and int(cpus) > 0 and environ.get("SLURM_STEP_ID") is not None:
        return int(cpus), "SLURM_CPUS_PER_TASK"
    n = local_ranks(environ)
    if not n or n <= 1:
        return None, "one rank on this node: the BLAS library's default"
    c = cores(environ)
    return max(1, c // n), f"{c} cores in the affinity mask / {n} ranks on this node"


def set_default_threads(environ=os.environ, modules=sys.modules) -> int | None:
    """Set the thread variables the user left unset; returns the count set, or None."""
    global CHOICE
    set_by_user = [v for v in VARS if v in environ]
    if set_by_user:
        CHOICE = (None, "set by the user: " + ", ".join(f"{v}={environ[v]}" for v in set_by_user))
    per, why = choose(environ)
    if per is None or "numpy" in modules or len(set_by_user) == len(VARS):
        if not set_by_user:
            CHOICE = (None, why if "numpy" not in modules else "NumPy was loaded before mpitp: its default")
        return None
    for var in VARS:
        environ.setdefault(var, str(per))
    CHOICE = (per, why)
    return per
