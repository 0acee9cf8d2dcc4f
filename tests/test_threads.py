"""BLAS threads per rank (mpitp.threads): set under a multi-rank launcher, left alone otherwise."""
import os
import subprocess
import sys

from mpitp import launch
from mpitp.threads import VARS, local_ranks, set_default_threads

CODE = ("import mpitp, os; from mpi4py import MPI; "
        "r = MPI.COMM_WORLD.gather(tuple(os.environ.get(v) for v in {vars})); "
        "MPI.COMM_WORLD.rank or print(r)")


def test_launcher_variables():
    assert local_ranks({"MPI_LOCALNRANKS": "3"}) == 3                        # MPICH hydra
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4             # Open MPI
    assert local_ranks({"SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_LOCALID": "1"}) == 2
    assert local_ranks({}) is None


def test_only_unset_variables_and_only_with_several_ranks():
    env = {"MPI_LOCALNRANKS": "2", "OMP_NUM_THREADS": "7"}
    assert set_default_threads(env, modules={}) is not None               # NumPy not loaded yet
    assert env["OMP_NUM_THREADS"] == "7" and env["OPENBLAS_NUM_THREADS"] == env["MKL_NUM_THREADS"]
    single = {"MPI_LOCALNRANKS": "1"}
    assert set_default_threads(single, modules={}) is None and not any(v in single for v in VARS)
    late = {"MPI_LOCALNRANKS": "2"}
    assert set_default_threads(late, modules={"numpy": None}) is None and not any(v in late for v in VARS)


def test_under_mpiexec_every_rank_gets_cores_over_ranks():
    """A real launch with no thread variables set: each of 3 ranks gets max(1, cores // 3)."""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = launch.command(3, [sys.executable, "-c", CODE.format(vars=VARS)], timeout=60)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-2000:]
    per = str(max(1, len(os.sched_getaffinity(0)) // 3))
    assert res.stdout.strip() == str([(per, per, per)] * 3), res.stdout
