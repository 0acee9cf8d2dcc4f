"""The mpitp command: --help, info, and the demo under a real mpiexec."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # info and demo under each mpiexec

MPITP = [sys.executable, "-m", "mpitp.cli.main"]


def test_help_lists_commands():
    out = subprocess.run(MPITP + ["--help"], capture_output=True, text=True, check=True).stdout
    assert "info" in out and "demo" in out and "mpiexec" in out


def test_info_json_under_mpiexec():
    res = launch.run(
        3, MPITP + ["info", "--json"], timeout=60, env={**__import__("os").environ, "MPITP_RANKS_PER_NODE": "2"}
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["world_size"] == 3
    assert data["nodes"] == [[0, 1], [2]] and data["leaders"] == [0, 2]
    assert data["cuda_aware_mpi"] in (True, False)
    assert data["numpy"] == np.__version__
    assert ("MPICH" in data["mpi_library"]) or ("Open MPI" in data["mpi_library"])


def test_demo_tables_at_four_ranks():
    res = launch.run(4, MPITP + ["demo"], timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # rank r starts with [10r+1 .. 10r+4]; the element-wise sum is 4*(k+1) + 60
    assert out.count("[64 68 72 76]") == 1 + 4 + 0  # reduce on root + allreduce on 4 ranks
    assert "[ 1 11 21 31]" in out  # alltoall: rank 0 gets element 0 of everyone
    assert "reduce_scatter" in out and "[64]" in out and "[76]" in out
