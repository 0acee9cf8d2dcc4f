"""Run every per-rank suite in tests/mpi/ under a real mpiexec at world sizes 1-4, and the
cases whose outcome depends on the world size again at 5-8 oversubscribed ranks and over
the ring's MPI transport.

One mpiexec launch per world size (and variant) runs all the files it needs: a launch pays
Python's start, the imports and numba's cache load once, not once per file. Each file's
outcome is still its own test here (``test_suite[test_allreduce.py-3]``), read from the
JSON lines every rank writes as each test finishes (tests/mpi/conftest.py,
tests/suite_report.py): a test fails here if it failed on any rank, and a launch that died
part way (a watchdog abort, a timeout) fails every file it did not finish, with the
launch's output.

Each launch has a time limit (MPIEXEC_TIMEOUT / --timeout, plus a kill of the whole
process group), and ranks run with the mpitp watchdog on, so a hang fails in seconds with
a message instead of eating CI's time. A test that skips inside a suite is reported here
as a warning naming the suite, world size and reason (in CI, a skip for something missing
fails the inner run itself: see conftest.py).
"""

import functools
import os
import sys
from pathlib import Path

import pytest
import suite_report

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # every collective and layer, run by each library's mpiexec

HERE = Path(__file__).parent
ROOT = HERE.parent
SUITES = sorted(p.name for p in (HERE / "mpi").glob("test_*.py"))
FLAVOR = launch.flavor()
MIN_RANKS = {"test_validation.py": 2}  # a mismatch needs two ranks to disagree

# 5-8 oversubscribed ranks: only what the world size changes. Three simulated nodes of
# uneven size for the two-level all-reduce (chunking, leaders, plan bytes; one dtype per
# kind of reduction instead of the 1-4 rank runs' six), uneven head and column cuts at 5.
TWO_LEVEL = "test_hierarchical.py"
SIZE_CASES = "not test_matches_mpi or float32-sum or int64-sum"  # test_matches_mpi's grid: two of its dtypes
EXTRA_SIZES = {
    5: [TWO_LEVEL, "test_tp_layers.py", "test_llama.py"],
    6: [TWO_LEVEL],
    7: [TWO_LEVEL],
    8: [TWO_LEVEL],
}
# the ring over MPI point-to-point, as across nodes (one node uses shared memory by
# default): the ring's own cases (the all-reduce ring, its segments and pipeline, the
# ring reduce-scatter and all-gather, their byte counts), at 2-4 ranks
MPI_TRANSPORT = ["test_allreduce.py", "test_collectives.py", "test_traffic.py"]
RING_CASES = "(ring or reduce_scatter or allgather) and not transports_agree"  # that one sets every transport itself
NO_SHM = {"MPITP_SHM": "0", "MPITP_CMA": "0"}


@functools.cache
def launch_files(n: int, files: tuple[str, ...], select: str = "", transport: str = "") -> dict:
    """Run ``files`` in one launch of ``n`` ranks (suite_report.run's form)."""
    report = suite_report.new_path(f"mpitp-suites-{n}-")
    env = dict(os.environ, MPITP_INNER="1", MPITP_TIMEOUT="60", PYTHONHASHSEED="0", MPITP_SUITE_REPORT=str(report))
    if transport == "mpi":
        env.update(NO_SHM)
    argv = [sys.executable, *suite_report.pytest_args(files, select)]
    return suite_report.read(launch.run(n, argv, timeout=1500, env=env, cwd=str(ROOT)), report)


def check(n: int, suite: str, files: list[str], select: str = "", transport: str = "") -> None:
    """Fail if ``suite``'s tests in that launch failed on any rank or did not all run."""
    where = f"{suite} at {n} ranks ({FLAVOR}{', ring over MPI' if transport else ''})"
    suite_report.judge(where, suite, launch_files(n, tuple(files), select, transport))


def launched(request, files: list[str]) -> list[str]:
    """The files of this test's launch: those of ``files`` whose test of the same kind and
    world size was collected (all of them in a full run; one when you ask for one)."""
    me = request.node
    mine = {
        it.callspec.params["suite"]
        for it in request.session.items
        if getattr(it, "originalname", None) == me.originalname and it.callspec.params["n"] == me.callspec.params["n"]
    }
    return [f for f in files if f in mine]


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite(request, suite, n):
    if n < MIN_RANKS.get(suite, 1):
        pytest.skip(f"{suite} needs at least {MIN_RANKS[suite]} ranks")
    check(n, suite, launched(request, [s for s in SUITES if n >= MIN_RANKS.get(s, 1)]))


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("suite,n", [(s, n) for n, files in EXTRA_SIZES.items() for s in files])
def test_suite_large(request, suite, n):
    check(n, suite, launched(request, EXTRA_SIZES[n]), select=SIZE_CASES)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("suite", MPI_TRANSPORT)
def test_suite_ring_over_mpi(request, suite, n):
    check(n, suite, launched(request, MPI_TRANSPORT), select=RING_CASES, transport="mpi")
