"""Run every per-rank suite in tests/mpi/ under a real mpiexec at world sizes 1-4.

Each launch has a time limit (MPIEXEC_TIMEOUT / --timeout, plus a kill of the whole
process group), and ranks run with the mpitp watchdog on, so a hang fails in seconds
with a message instead of eating CI's time. A test that skips inside a suite is reported
here as a warning naming the suite, world size and reason (in CI, a skip for something
missing fails the inner run itself: see conftest.py).
"""

import os
import re
import sys
import warnings
from pathlib import Path

import pytest

from mpitp import launch

HERE = Path(__file__).parent
ROOT = HERE.parent
SUITES = sorted(p.name for p in (HERE / "mpi").glob("test_*.py"))
FLAVOR = launch.flavor()
MIN_RANKS = {"test_validation.py": 2}  # a mismatch needs two ranks to disagree
EXTRA_SIZES = [(s, n) for s in ("test_hierarchical.py",) for n in (5, 6, 7, 8)]  # 3 nodes need room
EXTRA_SIZES += [(s, 5) for s in ("test_tp_layers.py", "test_llama.py")]  # uneven cuts at 5 ranks
# the ring over MPI point-to-point, as across nodes (one node uses shared memory by default)
MPI_TRANSPORT = [(s, n) for s in ("test_allreduce.py", "test_collectives.py", "test_traffic.py") for n in (2, 3, 4)]


def run_suite(suite: str, n: int, extra_env: dict | None = None, timeout: int = 420):
    env = dict(os.environ, MPITP_INNER="1", MPITP_TIMEOUT="60", PYTHONHASHSEED="0", **(extra_env or {}))
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "--with-mpi",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "--color=no",
        "--timeout=0",
        "--capture=sys",  # fd 2 stays the launcher's: a watchdog abort's message and stack reach us
        "-rs",  # the reason of every skip, reported below
        f"tests/mpi/{suite}",
    ]
    res = launch.run(n, argv, timeout=timeout, env=env, cwd=str(ROOT))
    if res.returncode != 0:
        pytest.fail(
            f"{suite} at {n} ranks ({FLAVOR}) exited {res.returncode}\n--- stdout\n{res.stdout[-8000:]}"
            f"\n--- stderr\n{res.stderr[-4000:]}",
            pytrace=False,
        )
    assert " passed" in res.stdout, res.stdout[-2000:]
    skips = sorted(set(re.findall(r"^SKIPPED \[\d+\] (.*)$", res.stdout, re.M)))
    if skips:
        warnings.warn(f"{suite} at {n} ranks ({FLAVOR}) skipped: " + "; ".join(skips), stacklevel=2)
    return res


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite(suite, n):
    if n < MIN_RANKS.get(suite, 1):
        pytest.skip(f"{suite} needs at least {MIN_RANKS[suite]} ranks")
    run_suite(suite, n)


@pytest.mark.parametrize("suite,n", EXTRA_SIZES)
def test_suite_large(suite, n):
    run_suite(suite, n)


@pytest.mark.parametrize("suite,n", MPI_TRANSPORT)
def test_suite_ring_over_mpi(suite, n):
    run_suite(suite, n, {"MPITP_SHM": "0", "MPITP_CMA": "0"})
