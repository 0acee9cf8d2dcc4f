"""bin/mpitp-run, bin/mpitp-rank-env, bin/mpitp-hostfile and the singleton guard, without
a scheduler (tests/test_slurm.py runs them under a real one)."""

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mpitp.launch import check_not_singleton, expand_nodelist

pytestmark = pytest.mark.both_mpis  # the launcher's flavour: mpiexec's flags, srun's PMI

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "bin"


def env_with(**kw):
    e = dict(os.environ, PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_CPUS_PER_TASK"):
        e.pop(k, None)
    e.update(kw)
    return e


def run(args, **kw):
    return subprocess.run(
        [str(BIN / "mpitp-run"), *args], capture_output=True, text=True, env=env_with(**kw), timeout=120
    )


def test_outside_slurm_uses_mpiexec():
    out = run(["-n", "3", "--dry-run", "--", "mpitp", "demo"])
    assert out.returncode == 0, out.stderr
    assert "mpiexec -n 3" in out.stdout and "mpitp-rank-env mpitp demo" in out.stdout


def test_hostfile_flag_per_flavor(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost:2\n")
    mpich = run(["-n", "2", "--hostfile", str(hf), "--dry-run", "hostname"], MPITP_MPI_FLAVOR="mpich")
    assert f"-f {hf}" in mpich.stdout
    ompi = run(["-n", "2", "--hostfile", str(hf), "--dry-run", "hostname"], MPITP_MPI_FLAVOR="openmpi")
    assert f"--hostfile {hf}" in ompi.stdout


@pytest.mark.parametrize("flavor,pmi", [("mpich", "pmi2"), ("openmpi", "pmix")])
def test_inside_allocation_uses_srun_with_the_right_pmi(tmp_path, flavor, pmi):
    fake = tmp_path / "srun"  # only needs to exist on PATH for the choice; --dry-run runs nothing
    fake.write_text("#!/bin/sh\nexit 99\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = run(
        ["--dry-run", "--threads", "2", "mpitp", "info"],
        SLURM_JOB_ID="42",
        SLURM_NTASKS="8",
        MPITP_MPI_FLAVOR=flavor,
        PATH=f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    assert out.returncode == 0, out.stderr
    assert f"srun --mpi={pmi} --kill-on-bad-exit=1 --ntasks=8 --cpus-per-task=2" in out.stdout
    # a site's (or user's) own choice is kept
    out = run(
        ["--dry-run", "mpitp", "info"],
        SLURM_JOB_ID="42",
        SLURM_NTASKS="8",
        SLURM_KILL_BAD_EXIT="0",
        MPITP_MPI_FLAVOR=flavor,
        PATH=f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    assert "--kill-on-bad-exit" not in out.stdout


def _fake(tmp_path, name, body):
    f = tmp_path / name
    f.write_text("#!/bin/sh\n" + body + "\n")
    f.chmod(f.stat().st_mode | stat.S_IEXEC)


def test_site_mpi_default_is_kept(tmp_path):
    _fake(tmp_path, "srun", "exit 99")
    _fake(tmp_path, "scontrol", 'echo "MpiDefault              = pmix_v4"')
    path = f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    out = run(["--dry-run", "mpitp", "info"], SLURM_JOB_ID="42", SLURM_NTASKS="2", MPITP_MPI_FLAVOR="mpich", PATH=path)
    assert "srun --kill-on-bad-exit=1 --ntasks=2" in out.stdout and "--mpi" not in out.stdout, out.stdout
    asked = run(
        ["--dry-run", "--mpi", "pmi2", "mpitp", "info"],
        SLURM_JOB_ID="42",
        SLURM_NTASKS="2",
        MPITP_MPI_FLAVOR="mpich",
        PATH=path,
    )
    assert "srun --mpi=pmi2" in asked.stdout


def test_intel_mpi_gets_slurms_pmi_library(tmp_path):
    _fake(tmp_path, "srun", "exit 99")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libpmi2.so").write_bytes(b"")
    out = run(
        ["--dry-run", "mpitp", "info"],
        SLURM_JOB_ID="42",
        SLURM_NTASKS="2",
        MPITP_MPI_FLAVOR="intel",
        SLURM_ROOT=str(tmp_path),
        PATH=f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    assert f"I_MPI_PMI_LIBRARY={tmp_path}/lib/libpmi2.so" in out.stderr, out.stderr


def test_flavor_detected_from_mpi4py():
    out = run(["--dry-run", "true"])
    assert "flavor=mpich" in out.stderr or "flavor=openmpi" in out.stderr


def test_rank_env_sets_threads_and_gpu_per_local_rank():
    code = (
        "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "r = c.gather((os.environ['OMP_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS'], "
        "os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ['MPITP_LOCAL_RANK'])); "
        "c.rank or print(r)"
    )
    out = run(["-n", "3", "--threads", "3", "--gpus-per-node", "2", sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    rows = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    # local ranks are a permutation of 0..2 (Open MPI 5 need not number them in world-rank
    # order); each rank's GPU is its local rank modulo the node's 2 GPUs
    assert sorted(int(lr) for *_, lr in rows) == [0, 1, 2], rows
    assert all((t, b, gpu) == ("3", "3", str(int(lr) % 2)) for t, b, gpu, lr in rows), rows


def test_help_and_bad_option():
    assert "srun" in run(["--help"]).stdout
    bad = run(["--frobnicate"])
    assert bad.returncode == 2 and "unknown option" in bad.stderr


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node01", ["node01"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[08-11,20],gpu1", ["n08", "n09", "n10", "n11", "n20", "gpu1"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_hostfile_writer_formats():
    env = env_with(SLURM_NTASKS_PER_NODE="4")
    ompi = subprocess.run([str(BIN / "mpitp-hostfile"), "n[1-2]"], capture_output=True, text=True, env=env)
    assert ompi.stdout == "n1 slots=4\nn2 slots=4\n", ompi.stderr
    mpich = subprocess.run(
        [str(BIN / "mpitp-hostfile"), "--format", "mpich", "--slots", "2", "a,b"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert mpich.stdout == "a:2\nb:2\n"
    none = subprocess.run([str(BIN / "mpitp-hostfile")], capture_output=True, text=True, env=env)
    assert none.returncode == 2 and "no node list" in none.stderr


def test_singleton_guard():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    msg = check_not_singleton(1, env)
    assert "--mpi=pmi2" in msg and "--mpi=pmix" in msg
    assert check_not_singleton(4, env) is None
    assert check_not_singleton(1, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert check_not_singleton(1, {}) is None
    # the batch script itself: one process in a 4-task job, not started by srun
    assert check_not_singleton(1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None
