"""BLAS threads per rank (mpitp.threads): set under a multi-rank launcher, left alone otherwise."""

import ast
import os
import subprocess
import sys

import pytest

from mpitp import launch
from mpitp.backend import device_for_rank
from mpitp.threads import VARS, choose, local_rank, local_ranks, set_default_threads

pytestmark = pytest.mark.both_mpis  # the variables each launcher sets per rank

CODE = (
    "import mpitp, os; from mpi4py import MPI; "
    "r = MPI.COMM_WORLD.gather(tuple(os.environ.get(v) for v in {vars})); "
    "MPI.COMM_WORLD.rank or print(r)"
)


def test_launcher_variables():
    assert local_ranks({"MPI_LOCALNRANKS": "3"}) == 3  # MPICH hydra
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4  # Open MPI
    assert local_ranks({"SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_LOCALID": "1"}) == 2
    assert local_ranks({}) is None


def test_only_unset_variables_and_only_with_several_ranks():
    env = {"MPI_LOCALNRANKS": "2", "OMP_NUM_THREADS": "7"}
    assert set_default_threads(env, modules={}) is not None  # NumPy not loaded yet
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


def test_slurm_cpus_per_task_decides_inside_a_step():
    env = {"SLURM_CPUS_PER_TASK": "6", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_LOCALID": "0"}
    assert choose(env) == (6, "SLURM_CPUS_PER_TASK")
    assert set_default_threads(env, modules={}) == 6 and env["OPENBLAS_NUM_THREADS"] == "6"
    # the batch script itself (no step): the launcher's rank count decides, as before
    assert choose({"SLURM_CPUS_PER_TASK": "6", "MPI_LOCALNRANKS": "2"})[0] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_gpu_per_local_rank():
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2 and local_rank({}) is None
    assert device_for_rank({"SLURM_LOCALID": "3"}, 2) == 1  # local rank mod GPUs seen
    assert device_for_rank({"MPI_LOCALRANKID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, 2) == 1
    assert device_for_rank({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "2"}, 1) is None  # already narrowed
    assert device_for_rank({}, 4) is None and device_for_rank({"SLURM_LOCALID": "1"}, 1) is None


def test_each_rank_picks_its_own_gpu_under_mpiexec():
    code = (
        "import os, mpitp; from mpitp.backend import device_for_rank; from mpi4py import MPI; "
        "r = MPI.COMM_WORLD.gather(device_for_rank(os.environ, 4)); MPI.COMM_WORLD.rank or print(r)"
    )
    res = launch.run(3, [sys.executable, "-c", code], timeout=60)
    assert res.returncode == 0, res.stderr
    # each its own GPU; which rank gets which follows the launcher's local-rank numbering
    # (Open MPI 5's need not follow world rank order)
    assert sorted(ast.literal_eval(res.stdout.strip())) == [0, 1, 2], res.stdout


def test_mpitp_threads_gives_blas_the_kernels_count():
    env = {"MPITP_THREADS": "3", "MPI_LOCALNRANKS": "2", "SLURM_CPUS_PER_TASK": "8", "SLURM_STEP_ID": "0"}
    assert choose(env) == (3, "MPITP_THREADS")


def test_the_kernels_launch_numbas_pool_before_any_cached_caller_loads(tmp_path):
    """The fused decode halves and the matmul drivers link parallel functions (taken only
    with threads). Compiled while such a callee came from numba's cache, a caller forgets to
    launch the pool when it is loaded later, and the process aborted ("Symbol not found:
    allocate_sched": the second `mpiexec -n 2 mpitp generate` after the int8 and kernel
    tests had filled the cache, reproduced with NUMBA_CACHE_DIR). So importing the kernels
    launches it, in a process that asks for one thread."""
    code = (
        "import numba.np.ufunc.parallel as p; assert not p._is_initialized; "
        "import mpitp.kernels.fused; print(p._is_initialized)"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), MPITP_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"]
